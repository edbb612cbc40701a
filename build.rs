//! Compiles Dapr's protocol definitions vendored under `proto/` (see proto/README.md) into the
//! messages, server and client of `dapr.proto.runtime.v1.Dapr` that `locks::dapr_grpc` serves.
//! `protox` is a protobuf compiler written in Rust: the build needs no `protoc` binary.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = protox::compile(["dapr/proto/runtime/v1/dapr.proto"], ["proto"])?;
    tonic_prost_build::configure()
        // The server and client are generic over the transport: the server runs on tonic's,
        // the client (used by the tests) on whatever channel they give it.
        .build_transport(false)
        // A message that does not decode is the caller's error: INVALID_ARGUMENT, not
        // tonic's INTERNAL (see `locks::dapr_grpc::Codec`).
        .codec_path("crate::locks::dapr_grpc::Codec")
        .compile_fds(files)?;
    Ok(())
}
