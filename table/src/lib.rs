//! `heapdump-table`: the shared-memory format between heapdump's in-process
//! agent (the writer) and its out-of-process dumper (the reader).
//!
//! A process being profiled owns two sealed memfd regions: `resources`
//! (append-only, deduplicated compressed stack traces and thread records,
//! see [`resources_table`]) and `allocations` (one record per live heap
//! block, see [`allocations_table`]). Both start with a versioned
//! [`header`]. Writers are many threads at once without a global lock;
//! readers map the regions read-only from another process and never block
//! or trust the writer: every key, offset and walk is checked and bounded.
//! This crate knows nothing of allocators or command lines.

#![deny(missing_docs)]

pub mod allocations_table;
pub mod byte_size;
pub mod error;
pub mod header;
pub mod peak;
pub mod region;
pub mod resources_table;
pub mod sampling;
pub mod shared_view;
pub mod stack_compression;
pub mod timeline;

pub use allocations_table::{
    AllocationRecord, AllocationsConfig, AllocationsReader, AllocationsWriter, InsertError,
    OwnedInsert, WalkStats, YoungRegistry,
};
pub use error::TableError;
pub use header::{
    Counters, DroppedReason, RegionKind, SnapshotRequest, FORMAT_MAJOR, FORMAT_MINOR,
};
pub use region::{monotonic_ns, RegionReader, RegionWriter};
pub use resources_table::{
    PeakAdd, ResourceKey, ResourcesReader, ResourcesWriter, StackCatalog, StackRecord, ThreadRecord,
};
pub use shared_view::SharedView;
