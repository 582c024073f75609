//! A fake kubelet's Registration server (records what plugins register), its pod resources server
//! (answers what the test sets), and a device plugin client.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use vgpu_proto::deviceplugin as dp;
use vgpu_proto::podresources as pr;

struct K(tokio::sync::mpsc::UnboundedSender<dp::RegisterRequest>);

#[tonic::async_trait]
impl dp::registration_server::Registration for K {
    async fn register(
        &self,
        r: tonic::Request<dp::RegisterRequest>,
    ) -> Result<tonic::Response<dp::Empty>, tonic::Status> {
        let _ = self.0.send(r.into_inner());
        Ok(tonic::Response::new(dp::Empty {}))
    }
}

/// Serves `router` on a fresh Unix socket at `sock` until the returned sender fires or is dropped.
fn serve_unix(sock: &Path, router: tonic::transport::server::Router) -> tokio::sync::oneshot::Sender<()> {
    let _ = std::fs::remove_file(sock);
    let l = tokio::net::UnixListener::bind(sock).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(router.serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(l), async {
        let _ = stopped.await;
    }));
    stop
}

/// Serves Registration on `<dir>/kubelet.sock` (recreated, as a restarted kubelet does).
pub fn start(
    dir: &Path,
    tx: tokio::sync::mpsc::UnboundedSender<dp::RegisterRequest>,
) -> tokio::sync::oneshot::Sender<()> {
    let svc = dp::registration_server::RegistrationServer::new(K(tx));
    serve_unix(&dir.join("kubelet.sock"), tonic::transport::Server::builder().add_service(svc))
}

/// A client of the plugin serving on `sock`.
pub async fn plugin(sock: PathBuf) -> dp::device_plugin_client::DevicePluginClient<tonic::transport::Channel> {
    dp::device_plugin_client::DevicePluginClient::new(vgpu_agent::sockets::unix_channel(&sock).await.unwrap())
}

/// Kubelet's Allocate for one container of the device IDs `ids`, on the plugin socket `sock`.
#[allow(dead_code)] // not every test binary allocates
pub async fn allocate(sock: PathBuf, ids: Vec<String>) -> Result<dp::AllocateResponse, tonic::Status> {
    plugin(sock)
        .await
        .allocate(dp::AllocateRequest { container_requests: vec![dp::ContainerAllocateRequest { devices_ids: ids }] })
        .await
        .map(tonic::Response::into_inner)
}

/// What the fake pod resources API answers (set by the test).
pub type PodList = Arc<Mutex<pr::ListPodResourcesResponse>>;

struct Lister(PodList);

#[tonic::async_trait]
impl pr::pod_resources_lister_server::PodResourcesLister for Lister {
    async fn list(
        &self,
        _: tonic::Request<pr::ListPodResourcesRequest>,
    ) -> Result<tonic::Response<pr::ListPodResourcesResponse>, tonic::Status> {
        Ok(tonic::Response::new(self.0.lock().unwrap().clone()))
    }
}

/// Serves the pod resources API on `sock` (made with its directory) until the sender fires.
pub fn serve_pod_resources(sock: &Path, list: PodList) -> tokio::sync::oneshot::Sender<()> {
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    let svc = pr::pod_resources_lister_server::PodResourcesListerServer::new(Lister(list));
    serve_unix(sock, tonic::transport::Server::builder().add_service(svc))
}

/// A container's devices: `(resource, ids)` entries.
pub type Devices<'a> = &'a [(&'a str, &'a [String])];

/// A pod whose containers, `(name, devices)`, hold these devices.
pub fn pod(name: &str, containers: &[(&str, Devices)]) -> pr::PodResources {
    pr::PodResources {
        name: name.into(),
        namespace: "default".into(),
        containers: containers
            .iter()
            .map(|(c, devs)| pr::ContainerResources {
                name: c.to_string(),
                devices: devs
                    .iter()
                    .map(|(r, ids)| pr::ContainerDevices { resource_name: r.to_string(), device_ids: ids.to_vec() })
                    .collect(),
            })
            .collect(),
    }
}
