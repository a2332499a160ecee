//! A bounds-checked view of a shared mapping that another process may be
//! writing at the same time.
//!
//! Invariants:
//! - The view never creates a Rust reference (`&[u8]`, `&T`) to the shared
//!   bytes: the other process may change them at any moment, and a reference
//!   would promise the compiler that they do not. Every read is an atomic
//!   `Relaxed` load of at most 8 bytes, which is defined for concurrently
//!   written memory and, per `core::sync::atomic`'s "Atomic accesses to
//!   read-only memory", also for a read-only mapping (relaxed, register
//!   width). Ordering is added by the caller with `fence(Acquire)`.
//! - Every read checks `offset + width <= len` and alignment first and
//!   returns `None` otherwise, so no byte pattern can make a reader touch
//!   memory outside the mapping.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};

/// A raw, length-checked window onto a mapping (read-only or read-write).
#[derive(Clone, Copy, Debug)]
pub struct SharedView {
    base: *const u8,
    len: usize,
}

// SAFETY: the view is a pointer and a length; every access through it is an
// atomic load, which is safe to perform from any thread.
unsafe impl Send for SharedView {}
// SAFETY: as above, shared access only performs atomic loads.
unsafe impl Sync for SharedView {}

impl SharedView {
    /// Wraps `len` bytes at `base`.
    ///
    /// # Safety
    /// `base..base+len` must stay mapped and readable for as long as the view
    /// (and every copy of it) is used, and `base` must be 8-byte aligned.
    pub unsafe fn new(base: *const u8, len: usize) -> Self {
        debug_assert_eq!(base as usize % 8, 0);
        SharedView { base, len }
    }

    /// Length of the window in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the window is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn in_bounds(&self, offset: u64, width: u64) -> Option<usize> {
        let end = offset.checked_add(width)?;
        if end > self.len as u64 || !offset.is_multiple_of(width) {
            return None;
        }
        Some(offset as usize)
    }

    /// The atomic at `offset`, if it lies wholly inside the view and is
    /// aligned.
    pub fn atomic_u64(&self, offset: u64) -> Option<&AtomicU64> {
        let off = self.in_bounds(offset, 8)?;
        // SAFETY: `off..off+8` is inside the mapping (checked above), the
        // mapping outlives `self` (constructor contract) and the address is
        // 8-aligned because `base` is and `off % 8 == 0`. AtomicU64 has the
        // same layout as u64 and all bit patterns are valid.
        Some(unsafe { &*(self.base.add(off) as *const AtomicU64) })
    }

    /// The 32-bit atomic at `offset` (checked like [`Self::atomic_u64`]).
    pub fn atomic_u32(&self, offset: u64) -> Option<&AtomicU32> {
        let off = self.in_bounds(offset, 4)?;
        // SAFETY: as in `atomic_u64`, for 4 bytes with 4-byte alignment.
        Some(unsafe { &*(self.base.add(off) as *const AtomicU32) })
    }

    /// The atomic at `offset` without a range check, for a writer whose
    /// offsets come from its own validated layout.
    ///
    /// # Safety
    /// `offset + 8 <= len` and `offset % 8 == 0`.
    #[inline(always)]
    pub(crate) unsafe fn atomic_u64_unchecked(&self, offset: u64) -> &AtomicU64 {
        debug_assert!(offset + 8 <= self.len as u64 && offset.is_multiple_of(8));
        // SAFETY: in bounds and aligned per the caller's contract; the
        // mapping outlives `self`.
        unsafe { &*(self.base.add(offset as usize) as *const AtomicU64) }
    }

    /// 32-bit form of [`Self::atomic_u64_unchecked`].
    ///
    /// # Safety
    /// `offset + 4 <= len` and `offset % 4 == 0`.
    #[inline(always)]
    pub(crate) unsafe fn atomic_u32_unchecked(&self, offset: u64) -> &AtomicU32 {
        debug_assert!(offset + 4 <= self.len as u64 && offset.is_multiple_of(4));
        // SAFETY: as above.
        unsafe { &*(self.base.add(offset as usize) as *const AtomicU32) }
    }

    /// Relaxed load of the u64 at `offset`; `None` when out of range.
    #[inline]
    pub fn load_u64(&self, offset: u64) -> Option<u64> {
        self.atomic_u64(offset).map(|a| a.load(Ordering::Relaxed))
    }

    /// Relaxed load of the u32 at `offset`; `None` when out of range.
    #[inline]
    pub fn load_u32(&self, offset: u64) -> Option<u32> {
        self.atomic_u32(offset).map(|a| a.load(Ordering::Relaxed))
    }

    /// Copies `len` bytes starting at `offset` into `out` (cleared first),
    /// with relaxed atomic loads. `None` when the range leaves the view.
    pub fn copy_bytes(&self, offset: u64, len: usize, out: &mut Vec<u8>) -> Option<()> {
        out.clear();
        let end = offset.checked_add(len as u64)?;
        if end > self.len as u64 {
            return None;
        }
        out.resize(len, 0);
        self.copy_into(offset, out)
    }

    /// Copies `out.len()` bytes starting at `offset` into `out`, with
    /// relaxed atomic loads and without allocating (the agent reads its
    /// own header this way from inside `malloc`). `None` when the range
    /// leaves the view (then `out` may be partly written).
    pub fn copy_into(&self, offset: u64, out: &mut [u8]) -> Option<()> {
        let end = offset.checked_add(out.len() as u64)?;
        if end > self.len as u64 {
            return None;
        }
        let mut pos = offset;
        let mut i = 0;
        // Word-at-a-time while aligned, bytes for the ragged ends.
        while pos < end && !pos.is_multiple_of(8) {
            out[i] = self.load_u8(pos)?;
            (pos, i) = (pos + 1, i + 1);
        }
        while pos + 8 <= end {
            out[i..i + 8].copy_from_slice(&self.load_u64(pos)?.to_le_bytes());
            (pos, i) = (pos + 8, i + 8);
        }
        while pos < end {
            out[i] = self.load_u8(pos)?;
            (pos, i) = (pos + 1, i + 1);
        }
        Some(())
    }

    fn load_u8(&self, offset: u64) -> Option<u8> {
        let off = self.in_bounds(offset, 1)?;
        // SAFETY: in bounds (checked), any alignment is fine for a byte.
        let a = unsafe { &*(self.base.add(off) as *const AtomicU8) };
        Some(a.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_outside_or_misaligned_are_refused() {
        let buf = [0u64; 4];
        // SAFETY: `buf` outlives the view and is 8-aligned.
        let v = unsafe { SharedView::new(buf.as_ptr() as *const u8, 32) };
        assert_eq!(v.load_u64(24), Some(0));
        assert_eq!(v.load_u64(32), None);
        assert_eq!(v.load_u64(28), None);
        assert_eq!(v.load_u64(3), None);
        assert_eq!(v.load_u64(u64::MAX - 3), None);
        let mut out = Vec::new();
        assert!(v.copy_bytes(30, 3, &mut out).is_none());
        assert!(v.copy_bytes(3, 20, &mut out).is_some());
        assert_eq!(out.len(), 20);
        let mut fixed = [7u8; 20];
        assert!(v.copy_into(3, &mut fixed).is_some());
        assert_eq!(fixed, [0u8; 20]);
        assert!(v.copy_into(13, &mut fixed).is_none());
    }
}
