//! redlock-sidecar: hold a Redlock (a lock on a quorum of independent Redis masters)
//! for the app next to it, with fencing tokens, and publish who leads.

/// Kubernetes integration: pod label, Events and Lease mirror, driven by the leadership channel.
pub mod k8s;
/// The one leadership state and its `watch` channel.
pub mod leadership;
/// The Redlock engine: quorum lock, fencing tokens, restart-safe votes.
pub mod redlock;
