//! The vgpu node agent's library: configuration, GPU discovery and health through NVML, slices,
//! the monitoring pass, the gRPC API, metrics and the daemon. `vgpuctl` is built from it too.
#![deny(clippy::too_many_lines)]

pub mod agent;
pub mod api;
pub mod capacity;
pub mod cdi;
pub mod config;
pub mod daemon;
pub mod describe;
pub mod deviceplugin;
pub mod discovery;
pub mod dra;
pub mod events;
pub mod hami;
pub mod health;
pub mod k8s;
pub mod metrics;
pub mod mig;
pub mod monitor;
pub mod mps;
pub mod notify;
pub mod procfs;
pub mod report;
pub mod slices;
pub mod sockets;

/// Entry points of the fuzz targets (`fuzz/`), also run over the stored corpora by the unit tests.
#[doc(hidden)]
pub mod fuzzing {
    /// A HAMi or Volcano device annotation, both encodings: decoded or refused, never a panic; each
    /// device ID split into GPU and MIG position, and the same bytes read as a scheduler's device
    /// configuration (its settings and MIG geometries) and as HAMi's per-node configuration.
    pub fn hami_decode(data: &[u8]) {
        let s = String::from_utf8_lossy(data);
        for trailing in [false, true] {
            if let Ok(v) = crate::hami::decode(&s, trailing) {
                for c in v.iter().flatten() {
                    assert!(c.uuid.len() <= s.len());
                    if let Ok((base, pos)) = crate::hami::split_device_id(&c.uuid) {
                        assert!(c.uuid.starts_with(base));
                        assert!(pos.is_none_or(|(g, _)| !g.is_empty() && !base.is_empty()));
                    }
                }
            }
        }
        // The same bytes as a whole device configuration's settings: read or refused, never a panic.
        if let Ok(Some(settings)) = crate::hami::parse_scheduler_settings(&s) {
            let _ = crate::deviceplugin::settings_mismatches(
                &settings,
                &crate::config::Config::from_toml("").expect("defaults"),
            );
        }
        // And as HAMi's per-node configuration (JSON).
        if let Ok(Some(e)) = crate::hami::hami_node_entry(&s, "node1") {
            assert!(e.split_count.is_none_or(|n| n > 0) && e.memory_scaling.is_none_or(|x| x > 0.0));
        }
        if let Ok(known) = crate::hami::parse_mig_geometries(&s) {
            for k in &known {
                let geometries = crate::hami::gpu_geometries(&known, &k.models[0], &[]);
                for (i, g) in geometries.iter().enumerate() {
                    assert!(g.templates.iter().all(|t| t.count > 0));
                    assert!(crate::hami::find_geometry(&geometries, &g.group).is_some());
                    assert!(
                        g.template_at(0).is_some() && crate::hami::find_geometry(&geometries, &i.to_string()).is_some()
                    );
                }
            }
        }
    }

    /// The agent's TOML configuration: accepted or refused with a message naming the key.
    pub fn agent_config(data: &[u8]) {
        if let Ok(text) = std::str::from_utf8(data) {
            if let Err(e) = crate::config::Config::from_toml(text) {
                assert!(!e.to_string().is_empty());
            }
        }
    }

    #[cfg(test)]
    mod tests {
        fn corpus(target: &str, f: fn(&[u8])) {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus").join(target);
            let mut n = 0;
            for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
                f(&std::fs::read(e.unwrap().path()).unwrap());
                n += 1;
            }
            assert!(n > 0);
        }

        #[test]
        fn the_fuzz_corpora_run_cleanly() {
            corpus("hami_decode", super::hami_decode);
            corpus("agent_config", super::agent_config);
        }
    }
}
