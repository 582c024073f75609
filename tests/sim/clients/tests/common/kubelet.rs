//! A fake kubelet's Registration server (records what plugins register) and a device plugin client.
use std::path::{Path, PathBuf};
use vgpu_proto::deviceplugin as dp;

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

/// Serves Registration on `<dir>/kubelet.sock` until the returned sender fires or is dropped.
pub fn start(
    dir: &Path,
    tx: tokio::sync::mpsc::UnboundedSender<dp::RegisterRequest>,
) -> tokio::sync::oneshot::Sender<()> {
    // A restarted kubelet recreates its socket.
    let sock = dir.join("kubelet.sock");
    let _ = std::fs::remove_file(&sock);
    let l = tokio::net::UnixListener::bind(&sock).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(dp::registration_server::RegistrationServer::new(K(tx)))
            .serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(l), async {
                let _ = stopped.await;
            }),
    );
    stop
}

/// A client of the plugin serving on `sock`.
pub async fn plugin(sock: PathBuf) -> dp::device_plugin_client::DevicePluginClient<tonic::transport::Channel> {
    let ch =
        tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
                let p = sock.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(p).await?))
                }
            }))
            .await
            .unwrap();
    dp::device_plugin_client::DevicePluginClient::new(ch)
}
