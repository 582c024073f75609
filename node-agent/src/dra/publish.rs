//! Publishing: the node's pool as ResourceSlices, written when its devices change.

use super::*;

/// The most devices one ResourceSlice may list (the API's limit); a pool with more spans several.
pub const SLICE_DEVICES: usize = 128;

/// The same, where devices consume counters.
pub const SLICE_DEVICES_WITH_COUNTERS: usize = 64;

/// The most counter sets one ResourceSlice may list; a ResourceSlice lists devices or counter
/// sets, not both.
pub const SLICE_COUNTER_SETS: usize = 8;

/// The node's pool as the parts of its ResourceSlices' specs: counter sets first (at most
/// [`SLICE_COUNTER_SETS`] a slice), then devices (at most [`SLICE_DEVICES`] a slice, or
/// [`SLICE_DEVICES_WITH_COUNTERS`] where they consume counters); one empty list of devices for an
/// empty pool.
pub fn pool_parts(pool: Pool) -> Vec<Value> {
    let per = if pool.devices.iter().any(|d| d.get("consumesCounters").is_some()) {
        SLICE_DEVICES_WITH_COUNTERS
    } else {
        SLICE_DEVICES
    };
    let mut parts: Vec<Value> =
        pool.counters.chunks(SLICE_COUNTER_SETS).map(|c| json!({"sharedCounters": c})).collect();
    parts.extend(pool.devices.chunks(per).map(|c| json!({"devices": c})));
    if parts.is_empty() {
        parts.push(json!({"devices": []}));
    }
    parts
}

/// The name of ResourceSlice `k` of the node's pool (`<node>-<driver>`, then `-1`, `-2`, ...).
pub fn pool_slice_name(node: &str, driver: &str, k: usize) -> String {
    let base = resource_slice_name(node, driver);
    if k == 0 {
        base
    } else {
        format!("{base}-{k}")
    }
}

/// How long what the API server kept of the pool is trusted (see [`Written`]).
pub(super) const WRITTEN_KEPT: Duration = Duration::from_secs(300);

/// Per ResourceSlice of the pool, the part last written and the spec the API server stored of it:
/// a server that drops fields it does not serve (consumable capacity without its feature gate) must
/// not make every pass a write.
pub(super) type Written = Vec<(Value, Value)>;

/// Writes the node's pool (its ResourceSlices, see [`pool_parts`]) when it differs from what the
/// API server has: every slice with the generation raised, and the slices a smaller pool no longer
/// needs removed.
pub(super) async fn publish(d: &Driver, owner: &Option<Value>, written: &mut Written) -> Result<bool, DraError> {
    let v = d.version().await?;
    let unpartitioned = d.agent.cfg.dra_mig == crate::config::DraMig::Dynamic && !v.partitions();
    d.agent.warn("dra-partitions", unpartitioned.then(|| NO_PARTITIONS.to_string()));
    let slices = v.resource("ResourceSlice", "resourceslices");
    let api: Api<DynamicObject> = Api::all_with(d.client.clone(), &slices);
    let chunks = pool_parts(pool(&d.agent, v));
    let name = |k: usize| pool_slice_name(&d.node, &d.driver, k);
    let get = |k: usize| {
        let api = api.clone();
        let n = name(k);
        async move { api.get_opt(&n).await.map_err(|e| DraError::Slice { what: "reading", name: n, source: Box::new(e) }) }
    };
    // What the pool is now: its first slice says how many there are.
    let first = get(0).await?;
    let count =
        first.as_ref().and_then(|o| o.data["spec"]["pool"]["resourceSliceCount"].as_u64()).unwrap_or(1) as usize;
    let generation = first.as_ref().and_then(|o| o.data["spec"]["pool"]["generation"].as_i64()).unwrap_or(0);
    let mut existing = vec![first];
    for k in 1..count.max(chunks.len()) {
        existing.push(get(k).await?);
    }
    let current = count == chunks.len()
        && chunks.iter().enumerate().all(|(k, want)| {
            existing[k].as_ref().is_some_and(|o| {
                let have = &v.v1_spec(&o.data["spec"]);
                have["driver"] == d.driver.as_str()
                    && have["pool"]["generation"].as_i64() == Some(generation)
                    && (same_part(have, want)
                        || written.get(k).is_some_and(|(sent, back)| same_part(sent, want) && same_part(back, have)))
            })
        });
    if current {
        return Ok(false);
    }
    let generation = generation + 1;
    let mut now = Vec::new();
    for (k, part) in chunks.iter().enumerate() {
        let mut spec = json!({
            "driver": d.driver,
            "nodeName": d.node,
            "pool": {"name": d.node, "generation": generation, "resourceSliceCount": chunks.len()},
        });
        for (key, value) in part.as_object().into_iter().flatten() {
            spec[key] = value.clone();
        }
        let spec = v.slice_spec(spec);
        let n = name(k);
        let stored = match existing[k].take() {
            Some(mut o) => {
                o.data["spec"] = spec;
                api.replace(&n, &PostParams::default(), &o).await.map_err(|e| DraError::Slice {
                    what: "updating",
                    name: n.clone(),
                    source: Box::new(e),
                })?
            }
            None => {
                let mut o = DynamicObject::new(&n, &slices);
                o.data = json!({"spec": spec});
                if let Some(owner) = owner {
                    o.metadata.owner_references = serde_json::from_value(json!([owner])).ok();
                }
                api.create(&PostParams::default(), &o).await.map_err(|e| DraError::Slice {
                    what: "creating",
                    name: n.clone(),
                    source: Box::new(e),
                })?
            }
        };
        now.push((part.clone(), v.v1_spec(&stored.data["spec"])));
    }
    for (k, _) in existing.iter().enumerate().skip(chunks.len()).filter(|(_, o)| o.is_some()) {
        let n = name(k);
        api.delete(&n, &Default::default()).await.map_err(|e| DraError::Slice {
            what: "removing",
            name: n.clone(),
            source: Box::new(e),
        })?;
    }
    // What the API server dropped of what was sent: a feature gate it lacks.
    let any = |f: &dyn Fn(&Value) -> bool, v: &Value| v["devices"].as_array().is_some_and(|v| v.iter().any(f));
    let dropped = |f: &dyn Fn(&Value) -> bool| {
        now.iter().any(|(sent, _)| any(f, sent)) && !now.iter().any(|(_, back)| any(f, back))
    };
    let gates = [
        (
            "dra-consumable-capacity",
            dropped(&|d: &Value| d["allowMultipleAllocations"] == true),
            "DRA: the API server dropped allowMultipleAllocations: consumable capacity needs the \
             DRAConsumableCapacity feature gate (API server and scheduler); until then each GPU goes to one claim \
             at a time, whole",
        ),
        (
            "dra-partitionable-devices",
            dropped(&|d: &Value| d.get("consumesCounters").is_some()),
            "DRA: the API server dropped consumesCounters: MIG partitions (dra_mig = \"dynamic\") need the \
             DRAPartitionableDevices feature gate (API server and scheduler); until then overlapping placements \
             may be allocated together, and their preparation fails",
        ),
    ];
    for (source, on, text) in gates {
        if on {
            tracing::warn!(resource_slice = %name(0), "{text}");
        }
        d.agent.warn(source, on.then(|| text.to_string()));
    }
    *written = now;
    Ok(true)
}

/// The Node object as the ResourceSlice's owner (the slice goes with the node).
pub(super) async fn node_owner(client: &kube::Client, node: &str) -> Option<Value> {
    let n = Api::<Node>::all(client.clone()).get(node).await.ok()?;
    Some(json!({"apiVersion": "v1", "kind": "Node", "name": node, "uid": n.metadata.uid?, "controller": true}))
}
