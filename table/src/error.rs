//! Typed errors of the table crate.

use std::io;

/// Everything that can go wrong creating, opening or reading a region.
#[derive(Debug, thiserror::Error)]
pub enum TableError {
    /// A system call failed while creating or mapping a region.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The memfd is not sealed against shrinking and growing, so the writer
    /// could truncate it under the reader and make it fault.
    #[error("region is not sealed against shrink/grow (seals {seals:#x}); refusing to map it")]
    Unsealed {
        /// The seals that were present.
        seals: i32,
    },
    /// The region is smaller than its header or than the size it claims.
    #[error("region is truncated: {what}")]
    Truncated {
        /// Which part does not fit.
        what: String,
    },
    /// The bytes do not start with heapdump's magic.
    #[error("not a heapdump region (bad magic)")]
    BadMagic,
    /// The region was written by an incompatible format version.
    #[error("unsupported heapdump format version {found_major}.{found_minor}: this build reads {supported_major}.x; use a heapdump built for the target's agent")]
    VersionMismatch {
        /// Major version found in the region.
        found_major: u16,
        /// Minor version found in the region.
        found_minor: u16,
        /// Major version this build supports.
        supported_major: u16,
    },
    /// The region is of another kind than expected.
    #[error("region kind is {found}, expected {expected}")]
    WrongKind {
        /// Kind number found.
        found: u32,
        /// Kind expected.
        expected: u32,
    },
    /// A header field is inconsistent (layout does not fit, zero counts...).
    #[error("corrupt region header: {0}")]
    CorruptHeader(String),
    /// A key does not name a valid record of the expected type.
    #[error("invalid resource key {key:#x}: {why}")]
    BadKey {
        /// The offending key.
        key: u64,
        /// Why it was rejected.
        why: &'static str,
    },
    /// A compressed stack trace could not be decoded.
    #[error("corrupt stack trace: {0}")]
    BadStack(#[from] crate::stack_compression::DecodeError),
    /// The region has no room left for this record.
    #[error("region full: {0}")]
    Full(&'static str),
    /// An input is larger than the format allows.
    #[error("too large: {0}")]
    TooLarge(&'static str),
}

impl TableError {
    pub(crate) fn io(what: &'static str, source: impl Into<io::Error>) -> Self {
        TableError::Io {
            what,
            source: source.into(),
        }
    }
}
