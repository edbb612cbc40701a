//! Clusters, proxies and engine configurations the scenarios share.

use super::*;

pub(crate) fn ready_cluster(n: usize, ttl: Duration) -> RedisCluster {
    block_in_place(|| RedisCluster::ready(n, ttl))
}

pub(crate) fn lib_config(lock: &str, identity: &str, urls: &[String]) -> RedlockConfig {
    let mut cfg = support::engine_config(urls, lock, identity, LIB_TTL);
    cfg.node_timeout = Duration::from_millis(50);
    cfg.connect_timeout = Duration::from_millis(250);
    cfg.retry_max = Duration::from_millis(100);
    cfg
}

/// One proxy per node, for one contender.
pub(crate) async fn proxies_for(cluster: &RedisCluster) -> Vec<FaultProxy> {
    let mut proxies = Vec::new();
    for addr in cluster.addrs() {
        proxies.push(FaultProxy::start(addr).await);
    }
    proxies
}

pub(crate) fn urls_of(proxies: &[FaultProxy]) -> Vec<String> {
    proxies.iter().map(FaultProxy::url).collect()
}

/// The earliest moment, measured from now, at which anyone can take `lock` over: the key must
/// be gone from a quorum of nodes, so it is the quorum-th smallest remaining ttl (0 where the key
/// is missing or the node is down).
pub(crate) fn earliest_takeover(cluster: &RedisCluster, lock: &str) -> Duration {
    let key = format!("redlock:{{{lock}}}");
    let mut left: Vec<Duration> = cluster
        .iter()
        .map(|node| {
            node.try_command(&["PTTL", &key])
                .ok()
                .and_then(|v| v.parse::<i64>().ok())
                .and_then(|ms| u64::try_from(ms).ok())
                .map_or(Duration::ZERO, Duration::from_millis)
        })
        .collect();
    left.sort();
    left[quorum(cluster.len()) - 1]
}

pub(crate) fn exit_code(status: std::process::ExitStatus) -> i32 {
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Waits (bounded) for a session that began at or after `after`, by someone other than `not`.
/// Panics naming `what` when none comes: the lock was not taken again.
pub(crate) async fn next_session(
    store: &FencedStore,
    after: Instant,
    not: Option<&str>,
    deadline: Duration,
    what: &str,
) -> (Instant, String, u64) {
    let found = |store: &FencedStore| {
        store
            .last_begin()
            .filter(|(at, who, _)| *at >= after && not.is_none_or(|n| n != who))
    };
    support::wait_for_async(deadline, what, || found(store)).await
}

/// Waits (bounded) until a session is open (begun, neither ended nor gone) and returns it.
pub(crate) async fn open_session(
    store: &FencedStore,
    deadline: Duration,
    what: &str,
) -> (Instant, String, u64) {
    let found = |store: &FencedStore| {
        store
            .last_begin()
            .filter(|(_, who, token)| store.is_open(who, *token))
    };
    support::wait_for_async(deadline, what, || found(store)).await
}
