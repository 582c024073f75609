//! The `vgpu.v1.Agent` gRPC service over the agent's Unix socket, and the client side that
//! `vgpuctl` and tests use.

use crate::agent::{Agent, ApiError};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use vgpu_proto::v1 as pb;
use vgpu_proto::v1::agent_server::AgentServer;

pub struct Service {
    agent: Arc<Agent>,
    /// The capacity reporter's connection state, for `vgpuctl capacity`.
    reporter: Arc<crate::report::ReporterState>,
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Status {
        match e {
            ApiError::Invalid(m) => Status::invalid_argument(m),
            ApiError::NotFound(m) => Status::not_found(m),
            ApiError::Exists(m) => Status::already_exists(m),
            ApiError::Busy(m) => Status::failed_precondition(m),
            ApiError::Full(m) => Status::resource_exhausted(m),
            ApiError::Internal(m) => Status::internal(m),
        }
    }
}

impl Service {
    async fn mig(&self, req: Request<pb::MigRequest>, op: crate::mig::Op) -> Result<Response<pb::MigReport>, Status> {
        self.ready()?;
        let a = self.agent.clone();
        let r = req.into_inner();
        Ok(Response::new(blocking(move || crate::mig::operate(&a, Some(r), op)).await?))
    }

    fn ready(&self) -> Result<(), Status> {
        if self.agent.ready.load(std::sync::atomic::Ordering::Acquire) {
            Ok(())
        } else {
            Err(Status::unavailable("the agent is starting: GPU discovery or the first monitoring pass is not done"))
        }
    }
}

pub fn server(agent: Arc<Agent>, reporter: Arc<crate::report::ReporterState>) -> AgentServer<Service> {
    AgentServer::new(Service { agent, reporter })
}

/// Runs a blocking slice operation (file system work) off the async threads.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, Status> {
    tokio::task::spawn_blocking(f).await.map_err(|e| Status::internal(e.to_string()))?.map_err(Status::from)
}

#[tonic::async_trait]
impl pb::agent_server::Agent for Service {
    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::NodeStatus>, Status> {
        self.ready()?;
        Ok(Response::new((*self.agent.live_status()).clone()))
    }

    type WatchStatusStream = ReceiverStream<Result<pb::NodeStatus, Status>>;

    async fn watch_status(
        &self,
        req: Request<pb::WatchStatusRequest>,
    ) -> Result<Response<Self::WatchStatusStream>, Status> {
        let min = Duration::from_millis(req.into_inner().min_interval_ms.clamp(10, 3_600_000) as u64);
        let mut rx = self.agent.subscribe();
        let agent = self.agent.clone();
        let (tx, out) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            loop {
                rx.borrow_and_update();
                let s = (*agent.live_status()).clone();
                if s.sequence > 0 && tx.send(Ok(s)).await.is_err() {
                    return;
                }
                tokio::time::sleep(min).await;
                // The next pass; or, while none comes and the monitoring has stalled, the same
                // status again with the stall's warning, every few seconds.
                loop {
                    match tokio::time::timeout(min.max(Duration::from_secs(2)), rx.changed()).await {
                        Ok(Ok(())) => break,
                        Ok(Err(_)) => return,
                        Err(_) if agent.stalled().is_some() => break,
                        Err(_) => {}
                    }
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(out)))
    }

    async fn capacity(&self, _: Request<pb::CapacityRequest>) -> Result<Response<pb::CapacityResponse>, Status> {
        self.ready()?;
        let a = self.agent.clone();
        let capacity = tokio::task::spawn_blocking(move || a.node_capacity())
            .await
            .map_err(|e| Status::internal(e.to_string()))?;
        let r = &self.reporter;
        use std::sync::atomic::Ordering::Relaxed;
        Ok(Response::new(pb::CapacityResponse {
            capacity: Some(capacity),
            endpoint: self.agent.cfg.scheduler.as_ref().map(|s| s.endpoint.to_string()).unwrap_or_default(),
            connected: r.connected.load(Relaxed),
            last_error: r.last_error.lock().clone(),
            reconnects: r.connections.load(Relaxed).saturating_sub(1),
        }))
    }

    async fn create_slice(&self, req: Request<pb::CreateSliceRequest>) -> Result<Response<pb::SliceDetail>, Status> {
        self.ready()?;
        let a = self.agent.clone();
        Ok(Response::new(blocking(move || a.create_slice(req.into_inner())).await?))
    }

    async fn update_slice(&self, req: Request<pb::UpdateSliceRequest>) -> Result<Response<pb::SliceDetail>, Status> {
        self.ready()?;
        let a = self.agent.clone();
        Ok(Response::new(blocking(move || a.update_slice(req.into_inner())).await?))
    }

    async fn delete_slice(
        &self,
        req: Request<pb::DeleteSliceRequest>,
    ) -> Result<Response<pb::DeleteSliceResponse>, Status> {
        let a = self.agent.clone();
        let r = req.into_inner();
        blocking(move || a.delete_slice(&r.name, r.force)).await?;
        Ok(Response::new(pb::DeleteSliceResponse {}))
    }

    async fn list_slices(&self, _: Request<pb::ListSlicesRequest>) -> Result<Response<pb::ListSlicesResponse>, Status> {
        // One slice that cannot be described (its files damaged under the agent) is left out and
        // logged; the others are listed.
        let slices = self
            .agent
            .slices()
            .iter()
            .filter_map(|s| {
                self.agent
                    .detail(s)
                    .map_err(|e| tracing::warn!(slice = %s.name, error = %e, "a slice left out of the list"))
                    .ok()
            })
            .collect();
        Ok(Response::new(pb::ListSlicesResponse { slices }))
    }

    async fn get_slice(&self, req: Request<pb::GetSliceRequest>) -> Result<Response<pb::SliceDetail>, Status> {
        Ok(Response::new(self.agent.get_slice(&req.into_inner().name)?))
    }

    async fn health(&self, _: Request<pb::HealthRequest>) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(self.agent.health_response()))
    }

    async fn mig_status(&self, _: Request<pb::MigStatusRequest>) -> Result<Response<pb::MigStatusResponse>, Status> {
        self.ready()?;
        let a = self.agent.clone();
        Ok(Response::new(blocking(move || crate::mig::agent_status(&a)).await?))
    }

    async fn mig_plan(&self, req: Request<pb::MigRequest>) -> Result<Response<pb::MigReport>, Status> {
        self.mig(req, crate::mig::Op::Plan).await
    }

    async fn mig_apply(&self, req: Request<pb::MigRequest>) -> Result<Response<pb::MigReport>, Status> {
        self.mig(req, crate::mig::Op::Apply).await
    }

    async fn mig_assert(&self, req: Request<pb::MigRequest>) -> Result<Response<pb::MigReport>, Status> {
        self.mig(req, crate::mig::Op::Assert).await
    }
}

/// The agent's socket could not be reached.
#[derive(Debug, thiserror::Error)]
#[error("cannot reach the agent at {}{} (is vgpu-node-agent running? see `vgpuctl doctor`)", path.display(), std::error::Error::source(source).map_or(String::new(), |s| format!(": {s}")))]
pub struct UnreachableError {
    pub path: std::path::PathBuf,
    pub source: tonic::transport::Error,
}

/// A client of the agent on the Unix socket at `path`.
pub async fn connect(
    path: &Path,
) -> Result<pb::agent_client::AgentClient<tonic::transport::Channel>, UnreachableError> {
    let channel = crate::sockets::unix_channel(path)
        .await
        .map_err(|source| UnreachableError { path: path.to_owned(), source })?;
    Ok(pb::agent_client::AgentClient::new(channel))
}
