//! tonic's codec with prost's encoding, except that a request that does not decode is the
//! caller's error (INVALID_ARGUMENT), never a panic nor INTERNAL.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{DecodeBuf, EncodeBuf};
use tonic::Status;

/// tonic's codec with prost's encoding, except that a request that does not decode is the
/// caller's error: INVALID_ARGUMENT (tonic answers INTERNAL).
#[derive(Debug)]
pub struct Codec<T, U>(PhantomData<fn(T, U)>);

impl<T, U> Default for Codec<T, U> {
    fn default() -> Self {
        Codec(PhantomData)
    }
}

/// [`Codec`]'s encoder.
#[derive(Debug)]
pub struct Encoder<T>(PhantomData<fn(T)>);

/// [`Codec`]'s decoder.
#[derive(Debug)]
pub struct Decoder<U>(PhantomData<fn() -> U>);

impl<T, U> tonic::codec::Codec for Codec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = Encoder<T>;
    type Decoder = Decoder<U>;

    fn encoder(&mut self) -> Encoder<T> {
        Encoder(PhantomData)
    }

    fn decoder(&mut self) -> Decoder<U> {
        Decoder(PhantomData)
    }
}

impl<T: Message> tonic::codec::Encoder for Encoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("cannot encode the answer: {e}")))
    }
}

impl<U: Message + Default> tonic::codec::Decoder for Decoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        decode_message(src).map(Some)
    }
}

/// One message of type `U` from `src`, or INVALID_ARGUMENT saying why it does not decode.
pub fn decode_message<U: Message + Default>(src: impl prost::bytes::Buf) -> Result<U, Status> {
    U::decode(src).map_err(|e| Status::invalid_argument(format!("malformed request message: {e}")))
}
