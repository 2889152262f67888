//! The controller against a **real** kube-apiserver (`scripts/cluster.sh up`: etcd and
//! kube-apiserver built from their Go modules, with the controller-manager and scheduler; the
//! chart's CRDs, RBAC, ValidatingAdmissionPolicies and webhook configurations installed; the
//! `ic-controller run` binary running as the chart's ServiceAccount and answering the
//! apiserver's webhook calls). Every test acts as a user would — through the API — and watches
//! what the running controller does: real watches, server-side apply with field managers, the
//! apiserver's own admission chain (webhooks, CEL, admission policies), garbage collection.
//!
//! The suite fails (never skips) without a running cluster; `scripts/test.sh` starts one.
//! docs/real-cluster.md lists what each test proves.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod support;

mod admission;
mod data_plane;
mod events;
mod fail_open;
mod followers;
mod identity;
mod leader;
mod model_cache;
mod nodes;
mod workloads;
