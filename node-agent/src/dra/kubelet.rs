//! The kubelet's side: the DRA service (`v1` and `v1beta1`), device health, plugin registration
//! and the sockets they are served on.

use super::*;

// The two API versions have the same messages; each is answered from the neutral form.
macro_rules! dra_service {
    ($m:ident) => {
        #[tonic::async_trait]
        impl $m::dra_plugin_server::DraPlugin for Driver {
            async fn node_prepare_resources(
                &self,
                req: Request<$m::NodePrepareResourcesRequest>,
            ) -> Result<Response<$m::NodePrepareResourcesResponse>, Status> {
                let claims = req.into_inner().claims.into_iter().map(|c| (c.namespace, c.uid, c.name)).collect();
                let claims = self
                    .prepare_all(claims)
                    .await
                    .into_iter()
                    .map(|(uid, r)| {
                        let resp = match r {
                            Ok(devices) => $m::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|p| $m::Device {
                                        request_names: vec![p.request],
                                        pool_name: p.pool,
                                        device_name: p.device,
                                        cdi_device_ids: p.cdi,
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(e) => $m::NodePrepareResourceResponse { devices: Vec::new(), error: e.to_string() },
                        };
                        (uid, resp)
                    })
                    .collect();
                Ok(Response::new($m::NodePrepareResourcesResponse { claims }))
            }

            async fn node_unprepare_resources(
                &self,
                req: Request<$m::NodeUnprepareResourcesRequest>,
            ) -> Result<Response<$m::NodeUnprepareResourcesResponse>, Status> {
                let claims = req
                    .into_inner()
                    .claims
                    .into_iter()
                    .map(|c| {
                        let error = self.unprepare(&c.uid).err().map(|e| e.to_string()).unwrap_or_default();
                        if !error.is_empty() {
                            tracing::warn!(uid = %c.uid, error = %error, "DRA claim not unprepared");
                        }
                        (c.uid, $m::NodeUnprepareResourceResponse { error })
                    })
                    .collect();
                Ok(Response::new($m::NodeUnprepareResourcesResponse { claims }))
            }
        }
    };
}
dra_service!(v1);
dra_service!(v1beta1);

/// How often the whole list goes to kubelet again when nothing changed: kubelet holds a report for
/// a while, then takes its devices' health as unknown.
pub(super) const HEALTH_RESEND: Duration = Duration::from_secs(5);

pub(super) type HealthStream =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<hp::NodeWatchResourcesResponse, Status>> + Send>>;

/// Device health for kubelet (KEP 4680: a pod's status shows the health of the devices its claims
/// hold): every device of the driver on the node with its GPU's health, at once, on every change
/// (checked every 500 ms) and every [`HEALTH_RESEND`].
#[tonic::async_trait]
impl hp::dra_resource_health_server::DraResourceHealth for Driver {
    type NodeWatchResourcesStream = HealthStream;

    async fn node_watch_resources(
        &self,
        _: Request<hp::NodeWatchResourcesRequest>,
    ) -> Result<Response<HealthStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let d = self.clone();
        tokio::spawn(async move {
            let mut last: Option<Vec<(String, bool)>> = None;
            let mut sent = tokio::time::Instant::now();
            loop {
                let a = d.agent.clone();
                // (Until the API version is known, the devices as `v1` would carry them.)
                let v = d.version.get().copied().unwrap_or(ApiVersion::V1);
                let Ok(now) = tokio::task::spawn_blocking(move || device_health(&a, v)).await else { break };
                if last.as_ref() != Some(&now) || sent.elapsed() >= HEALTH_RESEND {
                    let t = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |t| t.as_secs() as i64);
                    let devices = now
                        .iter()
                        .map(|(name, healthy)| hp::DeviceHealth {
                            device: Some(hp::DeviceIdentifier { pool_name: d.node.clone(), device_name: name.clone() }),
                            health: if *healthy { hp::HealthStatus::Healthy } else { hp::HealthStatus::Unhealthy }
                                as i32,
                            last_updated_time: t,
                        })
                        .collect();
                    if tx.send(Ok(hp::NodeWatchResourcesResponse { devices })).await.is_err() {
                        break;
                    }
                    last = Some(now);
                    sent = tokio::time::Instant::now();
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = tx.closed() => break,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }
}

/// What the plugin tells kubelet's plugin watcher.
#[derive(Clone)]
pub(super) struct Registrar {
    pub(super) driver: String,
    pub(super) endpoint: PathBuf,
}

#[tonic::async_trait]
impl reg::registration_server::Registration for Registrar {
    async fn get_info(&self, _: Request<reg::InfoRequest>) -> Result<Response<reg::PluginInfo>, Status> {
        Ok(Response::new(reg::PluginInfo {
            r#type: "DRAPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.display().to_string(),
            supported_versions: vec![
                "v1.DRAPlugin".into(),
                "v1beta1.DRAPlugin".into(),
                "v1alpha1.DRAResourceHealth".into(),
            ],
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<reg::RegistrationStatus>,
    ) -> Result<Response<reg::RegistrationStatusResponse>, Status> {
        let s = req.into_inner();
        if s.plugin_registered {
            tracing::info!(driver = %self.driver, "registered with kubelet as a DRA driver");
        } else {
            tracing::error!(driver = %self.driver, error = %s.error, "kubelet refused the DRA driver");
        }
        Ok(Response::new(reg::RegistrationStatusResponse {}))
    }
}

/// Kubelet's plugin directories: `plugins_registry` and `plugins`, under its root directory.
///
/// The registration socket's name ends in `@localhost`. Kubelet's plugin watcher dials it with
/// grpc-go, which sends the socket's path, percent-encoded, as the HTTP/2 `:authority`; a
/// percent-encoded host is not a valid authority, and the HTTP/2 server under tonic resets every
/// such stream (kubelet logs `RST_STREAM with error code: PROTOCOL_ERROR`). With the `@`, the path
/// becomes the authority's user information and `localhost` its host, which RFC 3986 allows.
pub fn sockets(cfg: &crate::config::Config, driver: &str) -> (PathBuf, PathBuf) {
    let root = &cfg.kubelet_root_dir;
    (
        root.join("plugins_registry").join(format!("{driver}-reg.sock@localhost")),
        root.join("plugins").join(driver).join("dra.sock"),
    )
}

/// The registration socket earlier versions made, which kubelet could not use; removed at start.
pub(super) fn former_registration_socket(cfg: &crate::config::Config, driver: &str) -> PathBuf {
    cfg.kubelet_root_dir.join("plugins_registry").join(format!("{driver}-reg.sock"))
}
