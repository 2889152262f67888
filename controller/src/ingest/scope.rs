//! What a node agent's stream may put into the index (docs/security.md "Node scope" and
//! "Input bounds"), applied by the ingest session before anything reaches the index:
//!
//! - **node scope** — with plans derived on this replica, a node agent may report only streams
//!   of engine pods the plans place on its node
//!   ([`NodeRegistry::node_may_report`](super::registry::NodeRegistry::node_may_report)); a
//!   stream of another node's (or tenant's) pod is left out of its resync, its deltas are
//!   dropped, and each is counted (`kv_streams_refused_total{reason="outside_node_scope"}`).
//!   Standalone mode derives no plans and keeps no node scope.
//! - **block sizes** — an entry or op with a block size above
//!   [`MAX_BLOCK_SIZE`](ic_shared::limits::MAX_BLOCK_SIZE), or one that would register more
//!   than [`MAX_BLOCK_SIZES`](ic_shared::limits::MAX_BLOCK_SIZES) distinct sizes for a hash
//!   scheme, is dropped and counted (`reason="block_size_cap"`); the rest of its stream is kept.
//!   Every tenant's first [`BLOCK_SIZE_FLOOR_PER_TENANT`] sizes of a scheme are admitted
//!   whatever other tenants registered: only sizes beyond that floor compete for the scheme's
//!   shared budget (issue 38 Deliver 4: a tenant must not refuse another tenant's stream).
//! - **hash schemes and block sizes per tenant** (issue 38 item 5: 32 schemes × 64 sizes made
//!   one 1 M-token lookup take 8.6 s) — a tenant may register at most
//!   [`MAX_HASH_SCHEMES_PER_TENANT`] hash schemes and [`MAX_BLOCK_SIZES_PER_TENANT`]
//!   (scheme, block size) pairs, and the index at most [`MAX_OTHER_HASH_SCHEMES`] schemes besides
//!   the engines' own;
//!   what would pass a cap is dropped and counted the same way (`reason="block_size_cap"`). A
//!   tenant's lookup then hashes its prompt at most 64 times, whatever it names.

use std::collections::{BTreeMap, BTreeSet};

use ic_shared::limits::{MAX_BLOCK_SIZE, MAX_BLOCK_SIZES};
use ic_shared::proto::{self, kv_op::Op};

/// Most hash schemes one tenant may register (the engines speak two: `vllm`, `sglang`).
pub const MAX_HASH_SCHEMES_PER_TENANT: usize = 4;
/// Most distinct (hash scheme, block size) pairs one tenant may register: a lookup of the
/// tenant chunks and hashes its prompt once per block size, so this bounds that work to what
/// one scheme could cost before.
pub const MAX_BLOCK_SIZES_PER_TENANT: usize = MAX_BLOCK_SIZES;
/// Block sizes per hash scheme every tenant may register whatever other tenants registered
/// (its first ones: real engines use one or two). Sizes within a tenant's floor are admitted
/// whatever the scheme's shared [`MAX_BLOCK_SIZES`] budget holds; only its sizes beyond the
/// floor compete for that budget (admitted while the scheme holds fewer than
/// [`MAX_BLOCK_SIZES`] sizes, every tenant's included, or when the size is registered already).
/// So one tenant's 64 sizes cannot refuse another tenant's stream (issue 38 Deliver 4). The
/// per-tenant caps ([`MAX_HASH_SCHEMES_PER_TENANT`], [`MAX_BLOCK_SIZES_PER_TENANT`]) still
/// apply to it. A scheme then holds at most `MAX_BLOCK_SIZES + 4 × tenants` sizes (and never
/// more than [`MAX_BLOCK_SIZE`] distinct ones).
pub const BLOCK_SIZE_FLOOR_PER_TENANT: usize = 4;
/// Most hash schemes the whole index may hold besides the engines' own (`vllm`, `sglang`, which
/// are always admitted, so other tenants' names cannot crowd them out): a tenant-less lookup
/// walks all of them.
pub const MAX_OTHER_HASH_SCHEMES: usize = 8;

/// What the index has registered ([`crate::index::RegisteredBlockSizes`]).
pub use crate::index::RegisteredBlockSizes as Registered;

/// The block sizes registered per hash scheme and per tenant, and the caps new ones are held
/// to.
#[derive(Debug, Default)]
pub struct BlockSizeBudget {
    sizes: BTreeMap<String, BTreeSet<u32>>,
    tenants: BTreeMap<String, BTreeSet<(String, u32)>>,
}

impl BlockSizeBudget {
    /// A budget starting from the index's registered sizes
    /// (`PrefixIndex::registered_block_sizes`).
    pub fn new((sizes, tenants): Registered) -> Self {
        BlockSizeBudget { sizes, tenants }
    }

    /// Whether `block_size` may be used for `scheme` by `tenant` (registering it when new and
    /// under every cap). A size within the tenant's [`BLOCK_SIZE_FLOOR_PER_TENANT`] for the
    /// scheme skips the scheme's shared [`MAX_BLOCK_SIZES`] cap (not the per-tenant ones).
    pub fn admit(&mut self, tenant: &str, scheme: &str, block_size: u32) -> bool {
        if block_size > MAX_BLOCK_SIZE {
            return false;
        }
        let pair = (scheme.to_string(), block_size);
        if self.tenants.get(tenant).is_some_and(|t| t.contains(&pair)) {
            return true;
        }
        let engine_scheme = |s: &str| ic_shared::plan::HashScheme::parse(s).is_some();
        if !self.sizes.contains_key(scheme)
            && !engine_scheme(scheme)
            && self.sizes.keys().filter(|s| !engine_scheme(s)).count() >= MAX_OTHER_HASH_SCHEMES
        {
            return false;
        }
        let mine = self.tenants.get(tenant);
        let size_known = self
            .sizes
            .get(scheme)
            .is_some_and(|set| set.contains(&block_size));
        // A tenant's first sizes of a scheme are its own (issue 38 Deliver 4: another tenant's
        // registrations must not refuse them); only the sizes beyond that floor compete for the
        // scheme's shared budget.
        let within_floor = tenant_sizes_of(mine, scheme) < BLOCK_SIZE_FLOOR_PER_TENANT;
        if !size_known
            && !within_floor
            && self.sizes.get(scheme).map_or(0, BTreeSet::len) >= MAX_BLOCK_SIZES
        {
            return false;
        }
        let tenant_has_scheme = mine.is_some_and(|t| t.iter().any(|(s, _)| s == scheme));
        if !tenant_has_scheme && tenant_schemes(mine) >= MAX_HASH_SCHEMES_PER_TENANT {
            return false;
        }
        if mine.map_or(0, BTreeSet::len) >= MAX_BLOCK_SIZES_PER_TENANT {
            return false;
        }
        self.sizes
            .entry(scheme.to_string())
            .or_default()
            .insert(block_size);
        self.tenants
            .entry(tenant.to_string())
            .or_default()
            .insert(pair);
        true
    }
}

fn tenant_sizes_of(pairs: Option<&BTreeSet<(String, u32)>>, scheme: &str) -> usize {
    pairs.map_or(0, |p| p.iter().filter(|(s, _)| s == scheme).count())
}

fn tenant_schemes(pairs: Option<&BTreeSet<(String, u32)>>) -> usize {
    pairs.map_or(0, |p| {
        p.iter()
            .map(|(s, _)| s.as_str())
            .collect::<BTreeSet<_>>()
            .len()
    })
}

/// Drops the snapshot's entries whose block size the budget refuses; returns how many.
pub fn cap_snapshot(snap: &mut proto::StreamSnapshot, budget: &mut BlockSizeBudget) -> usize {
    let (tenant, scheme) = snap
        .stream
        .as_ref()
        .map(|d| (d.tenant.clone(), d.hash_scheme.clone()))
        .unwrap_or_default();
    let before = snap.entries.len();
    // A stream's entries come in runs of one block size: ask the budget once per run.
    let mut last: Option<(u32, bool)> = None;
    snap.entries.retain(|e| match last {
        Some((size, ok)) if size == e.block_size => ok,
        _ => {
            let ok = budget.admit(&tenant, &scheme, e.block_size);
            last = Some((e.block_size, ok));
            ok
        }
    });
    before - snap.entries.len()
}

/// Drops the delta's Store/Remove ops whose block size the budget refuses (the delta and its
/// seq stay, so the stream does not fall out of sequence); returns how many.
pub fn cap_delta(delta: &mut proto::StreamDelta, budget: &mut BlockSizeBudget) -> usize {
    let (tenant, scheme) = delta
        .stream
        .as_ref()
        .map(|d| (d.tenant.clone(), d.hash_scheme.clone()))
        .unwrap_or_default();
    let before = delta.ops.len();
    delta.ops.retain(|op| match &op.op {
        Some(Op::Store(s)) => budget.admit(&tenant, &scheme, s.block_size),
        Some(Op::Remove(r)) => budget.admit(&tenant, &scheme, r.block_size),
        _ => true,
    });
    before - delta.ops.len()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    fn registered(scheme: &str, sizes: &[u32]) -> Registered {
        (
            [(scheme.to_string(), sizes.iter().copied().collect())].into(),
            [(
                "t".to_string(),
                sizes.iter().map(|s| (scheme.to_string(), *s)).collect(),
            )]
            .into(),
        )
    }

    #[test]
    fn block_sizes_above_the_cap_or_past_the_count_cap_are_refused() {
        let mut b = BlockSizeBudget::new(registered("vllm", &[16]));
        assert!(b.admit("t", "vllm", 16));
        assert!(!b.admit("t", "vllm", MAX_BLOCK_SIZE + 1));
        assert!(b.admit("t", "vllm", MAX_BLOCK_SIZE));
        // The attack registered 2 048 sizes; the count stops at the cap.
        let admitted = (1..=2048u32).filter(|s| b.admit("u", "sglang", *s)).count();
        assert_eq!(admitted, MAX_BLOCK_SIZES);
        assert!(!b.admit("u", "sglang", 2048));
        assert!(b.admit("u", "sglang", 1), "a registered size stays usable");
        // Another scheme has its own budget.
        assert!(b.admit("v", "vllm", 2048));
    }

    /// Issue 38 Deliver 4 (breaker D3): one tenant's 64 vLLM sizes left another tenant's
    /// genuine size-16 stream at 0 entries (`BlockSizeCapExceeded`). Every tenant's first
    /// sizes are now its own; only sizes beyond the floor compete for the shared budget.
    #[test]
    fn a_tenant_with_64_sizes_does_not_refuse_another_tenants_first_sizes() {
        let mut b = BlockSizeBudget::default();
        let taken = (100..200u32)
            .filter(|s| b.admit("attacker", "vllm", *s))
            .count();
        assert_eq!(taken, MAX_BLOCK_SIZES);
        for t in ["team-a", "team-b"] {
            for size in [16, 32, 8, 1].iter().take(BLOCK_SIZE_FLOOR_PER_TENANT) {
                assert!(b.admit(t, "vllm", *size), "{t} size {size}");
            }
            assert!(b.admit(t, "vllm", 16), "an admitted size stays usable");
        }
        // Beyond its floor a tenant competes for the full shared budget: a new size is refused,
        // one the scheme registered already is not.
        assert!(!b.admit("team-a", "vllm", 64));
        assert!(b.admit("team-a", "vllm", 100));
        // The attacker gets no more than before from the floors of the others.
        assert!(!b.admit("attacker", "vllm", 7));
        // Rebuilt from the index's registrations (as every resync does), the floor still holds.
        let mut b = BlockSizeBudget::new((b.sizes, b.tenants));
        assert!(b.admit("team-c", "vllm", 16));
        assert!(b.admit("team-a", "vllm", 32));
    }

    /// Issue 38 item 5: 32 schemes × 64 sizes of one tenant made a 1 M-token lookup take 8.6 s.
    /// A tenant now registers at most 4 schemes and 64 (scheme, size) pairs; the index at most
    /// 8 made-up schemes.
    #[test]
    fn hash_schemes_and_block_sizes_are_capped_per_tenant() {
        let mut b = BlockSizeBudget::default();
        let mut admitted = 0;
        for scheme in 0..32 {
            for size in 1..=64u32 {
                if b.admit("attacker", &format!("scheme-{scheme}"), size) {
                    admitted += 1;
                }
            }
        }
        assert_eq!(admitted, MAX_BLOCK_SIZES_PER_TENANT);
        let schemes: BTreeSet<&str> = b.tenants["attacker"]
            .iter()
            .map(|(s, _)| s.as_str())
            .collect();
        assert!(schemes.len() <= MAX_HASH_SCHEMES_PER_TENANT, "{schemes:?}");
        // Schemes spread over 64 sizes each stop at 4 per tenant.
        let mut b = BlockSizeBudget::default();
        let ok = (0..32)
            .filter(|s| b.admit("attacker", &format!("scheme-{s}"), 16))
            .count();
        assert_eq!(ok, MAX_HASH_SCHEMES_PER_TENANT);
        // Other tenants are not starved by the attacker's pairs; made-up schemes stop at 8 in
        // all, the engines' own stay usable for every tenant.
        assert!(b.admit("team-a", "vllm", 16));
        let more = (0..32)
            .filter(|t| b.admit(&format!("tenant-{t}"), &format!("other-{t}"), 16))
            .count();
        assert_eq!(more, MAX_OTHER_HASH_SCHEMES - MAX_HASH_SCHEMES_PER_TENANT);
        assert!(
            b.admit("team-b", "sglang", 16),
            "an engine scheme stays usable"
        );
    }
}
