//! vgpu's gRPC APIs: generated prost messages and tonic clients and servers.

/// The node agent's API (`vgpu.v1.Agent`).
pub mod v1 {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("vgpu.v1");
}

/// An escape's kind as JSON shows it: its name (`"UNACCOUNTED"`, `"OVER_LIMIT"`), not its number.
pub fn escape_kind<S: serde::Serializer>(kind: &i32, s: S) -> Result<S::Ok, S::Error> {
    let name = v1::escape::Kind::try_from(*kind).map_or("KIND_UNSPECIFIED", |k| k.as_str_name());
    s.serialize_str(name)
}

/// A slice's priority as JSON shows it: `"high"` or `"normal"`.
pub fn priority<S: serde::Serializer>(p: &i32, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if *p == v1::SlicePriority::PriorityHigh as i32 { "high" } else { "normal" })
}

/// The scheduler API (`vgpu.scheduler.v1`): node capacity streamed to the central scheduler, its
/// requests to the node, and the reference receiver's cluster view.
pub mod scheduler {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("vgpu.scheduler.v1");
    }
}

/// The kubelet device plugin API (`v1beta1`): our own `.proto` with upstream's messages and field
/// numbers.
pub mod deviceplugin {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1beta1");
}

/// The kubelet pod resources API (`v1`): which devices each container holds. Our own `.proto` with
/// upstream's messages and field numbers (only what vgpu reads).
pub mod podresources {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("v1");
}

/// The kubelet DRA plugin API (`v1` and `v1beta1`, the same messages) and the plugin registration
/// API: our own `.proto` files with upstream's services, messages and field numbers.
pub mod dra {
    pub mod v1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    pub mod v1beta1 {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
    pub mod registration {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("pluginregistration");
    }
    /// Device health (`v1alpha1.DRAResourceHealth`), streamed to kubelet for pods' status.
    pub mod health {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("v1alpha1");
    }
}
