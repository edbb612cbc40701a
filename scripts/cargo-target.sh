#!/usr/bin/env bash
# cargo_target_dir: where Cargo puts its output for this workspace (honours CARGO_TARGET_DIR,
# build.target-dir in .cargo/config.toml and the default `target/`). Sourced by the scripts
# that run a built binary; needs only cargo and sed (it also runs in the image's build stage).
cargo_target_dir() {
  cargo metadata --format-version 1 --no-deps --manifest-path "$(dirname "${BASH_SOURCE[0]}")/../Cargo.toml" \
    | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p'
}
