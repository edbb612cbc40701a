//! Locks for the app's requests: the critical section around a payment, a withdrawal or the
//! last item in stock, taken through the sidecar over HTTP from any language.
//!
//! The app asks `POST /v1/locks/{name}` on the loopback control listener and gets a lease
//! (an id issued here), a fencing token that only grows for the name, and the validity.
//! The sidecar renews the lock on the Redis nodes while the app keeps the lease alive, and
//! releases it when the app deletes it, stops keeping it alive for a ttl, or the sidecar
//! shuts down. See `docs/locks.md` for the API, Dapr compatibility and fencing recipes.
//!
//! | file | concern |
//! |---|---|
//! | [`api`] | what the lock routes share (HTTP and gRPC) |
//! | [`bounds`] | what a request may ask: names, ttls, waits |
//! | [`lease_id`] | lease ids: 128 random bits |
//! | [`keepalive`] | when a lease is renewed, released or lost: a pure decision |
//! | [`engine`] | the seam to the Redlock engine, and its namespace |
//! | [`idle`] | which names nobody uses keep their engine lock, and how long |
//! | [`wakes`] | when each lease is next looked at: one table of wake-ups for all |
//! | [`service`] | the lease table, its bounds, waiters, renewals and releases, shutdown |
//! | [`routes`] | the `/v1/locks` routes |
//! | [`dapr`] | Dapr's lock API, its metadata and health routes |
//! | [`dapr_grpc`] | Dapr's gRPC API (`--dapr-grpc-listen`) |

pub mod api;
pub mod bounds;
pub mod dapr;
pub mod dapr_grpc;
pub mod engine;
pub mod idle;
pub mod keepalive;
pub mod lease_id;
pub mod routes;
pub mod service;
pub mod wakes;

pub use api::Api;
pub use engine::{LockEngine, RedlockEngine};
pub use routes::router;
pub use service::Locks;
