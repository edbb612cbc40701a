//! Kubernetes integration (work in progress).
