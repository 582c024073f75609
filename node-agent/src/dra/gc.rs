//! Collection: the slices, records and specs of claims that are gone, which kubelet never
//! unprepared.

use super::*;

/// Whether the claim is gone (or made again under its name); false when that cannot be known now.
pub(super) async fn claim_gone(d: &Driver, ns: &str, name: &str, uid: &str) -> bool {
    let api = match d.claims(ns).await {
        Ok(api) => api,
        Err(e) => {
            tracing::debug!(error = %e, "cannot read prepared DRA claims");
            return false;
        }
    };
    match api.get_opt(name).await {
        Ok(None) => true,
        Ok(Some(c)) => c.metadata.uid.as_deref() != Some(uid),
        Err(e) => {
            tracing::debug!(claim = %format!("{ns}/{name}"), error = %e, "cannot read a prepared DRA claim");
            false
        }
    }
}

/// Removes the slices, and the records of devices given whole, of claims that are gone; returns how many.
pub(super) async fn collect(d: &Driver) -> usize {
    let mut removed = 0;
    for c in whole_claims(&d.agent, Whole::Mig).into_iter().chain(whole_claims(&d.agent, Whole::Admin)).map(|(_, c)| c)
    {
        if claim_gone(d, &c.namespace, &c.name, &c.uid).await && d.unprepare(&c.uid).is_ok() {
            tracing::info!(claim = %format!("{}/{}", c.namespace, c.name), devices = ?c.devices, "DRA claim's devices released: the claim is gone");
            removed += 1;
        }
    }
    for s in d.agent.slices().iter() {
        if s.labels.get("source").map(String::as_str) != Some("dra") {
            continue;
        }
        let label = |k: &str| s.labels.get(k).cloned().unwrap_or_default();
        let (ns, name, uid) = (label("namespace"), label("claim"), label("claim-uid"));
        if !claim_gone(d, &ns, &name, &uid).await {
            continue;
        }
        let (a, n) = (d.agent.clone(), s.name.clone());
        match tokio::task::spawn_blocking(move || a.delete_slice(&n, false)).await {
            Ok(Ok(())) => {
                tracing::info!(slice = %s.name, claim = %format!("{ns}/{name}"), "DRA slice removed: its claim is gone");
                d.agent.stats.slices_collected.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                removed += 1;
            }
            Ok(Err(e)) => tracing::debug!(slice = %s.name, error = ?e, "DRA slice of a gone claim kept for now"),
            Err(e) => tracing::warn!(slice = %s.name, error = %e, "DRA slice removal failed"),
        }
    }
    removed
}
