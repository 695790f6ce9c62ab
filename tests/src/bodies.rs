//! A pool's body store as the tests read it (issue 34's large bodies): an object read
//! back as any Object Store client reads it, a body's digest, and every subject the
//! store holds a message on, which tells the objects replies name from orphans.

use async_nats::jetstream;
use async_nats::jetstream::object_store::ObjectStore;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE;
use futures::StreamExt as _;
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncReadExt as _;
use webproxy_protocol::{BodyObject, Origin, Subjects};

use crate::large_body;

/// A body's digest as a reply's `body_object` and the object's info give it:
/// `SHA-256=` and the SHA-256 in padded base64url.
pub fn digest_of(bytes: &[u8]) -> String {
    format!("SHA-256={}", URL_SAFE.encode(Sha256::digest(bytes)))
}

/// Reads `name` from `store` as any Object Store client does (which checks the digest)
/// and compares it with the `size` bytes `GET /large/{size}` sends ([`large_body`]).
pub async fn assert_reads_back(store: &ObjectStore, name: &str, size: usize) {
    let mut bytes = Vec::with_capacity(size);
    store
        .get(name)
        .await
        .unwrap_or_else(|e| panic!("object {name}: {e}"))
        .read_to_end(&mut bytes)
        .await
        .unwrap_or_else(|e| panic!("object {name} read whole: {e}"));
    assert!(
        bytes == large_body(size),
        "the {size} bytes read back of {name} differ"
    );
}

/// Every subject `bucket`'s store holds a message on (`$O.<bucket>.>`: chunks,
/// metadata and receipts), with how many, sorted; `None` while the store cannot be
/// read.
pub async fn store_subjects(js: &jetstream::Context, bucket: &str) -> Option<Vec<(String, usize)>> {
    let stream = js.get_stream(Subjects::object_stream(bucket)).await.ok()?;
    let mut subjects = stream
        .info_with_subjects(format!("$O.{bucket}.>"))
        .await
        .ok()?;
    let mut held = Vec::new();
    while let Some(entry) = subjects.next().await {
        held.push(entry.ok()?);
    }
    held.sort();
    Some(held)
}

/// What a store holding exactly the bodies of `named` (each conversation's origin and
/// the object its reply names) holds, as [`store_subjects`] lists it: each object's
/// chunks (as many as its info says) and its metadata, and each conversation's
/// receipt, once.
pub async fn subjects_of(
    store: &ObjectStore,
    named: &[(&Origin, &BodyObject)],
) -> Vec<(String, usize)> {
    let mut expected = Vec::new();
    for (origin, object) in named {
        let info = store
            .info(&object.name)
            .await
            .unwrap_or_else(|e| panic!("the info of {}: {e}", object.name));
        expected.push((
            Subjects::object_chunks(&object.bucket, &info.nuid),
            info.chunks,
        ));
        expected.push((
            Subjects::object_meta(&object.bucket, &URL_SAFE.encode(&object.name)),
            1,
        ));
        expected.push((Subjects::body_receipt(&object.bucket, origin), 1));
    }
    expected.sort();
    expected
}

/// The conversation whose body `object` is: its name starts with the origin
/// (`<STREAM>:<seq>:<generation>:<attempt>:<delivery>`).
pub fn origin_of(object: &BodyObject) -> Option<Origin> {
    let mut fields = object.name.splitn(3, ':');
    let origin = format!("{}:{}", fields.next()?, fields.next()?);
    origin.parse().ok()
}

/// Which delivery of its message stored `object`: the last field of its name, 1 for
/// the first; more when a redelivery finished the body.
pub fn delivery_of(object: &BodyObject) -> Option<u64> {
    object.name.rsplit(':').next()?.parse().ok()
}
