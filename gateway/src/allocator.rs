//! The process's allocator: mimalloc, asked through its plain entry points
//! wherever they already give the alignment a layout needs.
//!
//! The `mimalloc` crate's `MiMalloc` calls `mi_malloc_aligned` for every
//! allocation; past its small-block fast path (blocks over 1 KiB: hyper's
//! buffers, response bodies) that is mimalloc's generic aligned path, ~3,000
//! instructions of a gateway request's ~144,000 under callgrind (BENCHMARKS.md,
//! "Gateway overhead"). `mi_malloc` returns blocks aligned to
//! `MI_MAX_ALIGN_SIZE` (16 bytes), or to 8 for blocks of 8 bytes: its size
//! classes are whole double words past one word (`mi_bin` in mimalloc's
//! `page-queue.c`). So a layout whose alignment is at most 16 and at most its
//! size needs nothing more than `mi_malloc`, as Rust's `System` allocator
//! reasons for glibc's `malloc`; the test below checks it.

use libmimalloc_sys as mi;
use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;

/// The alignment every mimalloc block of at least this size has
/// (`MI_MAX_ALIGN_SIZE`).
const MI_MAX_ALIGN_SIZE: usize = 16;

/// Whether `mi_malloc(size)` is aligned to `align` without asking.
fn naturally_aligned(size: usize, align: usize) -> bool {
    align <= MI_MAX_ALIGN_SIZE && align <= size
}

pub struct Mimalloc;

// SAFETY: every path hands the layout's size and alignment to mimalloc, whose
// blocks are valid until freed; the plain entry points only where
// `naturally_aligned` holds, which mimalloc guarantees (module note).
unsafe impl GlobalAlloc for Mimalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        unsafe {
            if naturally_aligned(size, align) {
                mi::mi_malloc(size).cast()
            } else {
                mi::mi_malloc_aligned(size, align).cast()
            }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let (size, align) = (layout.size(), layout.align());
        unsafe {
            if naturally_aligned(size, align) {
                mi::mi_zalloc(size).cast()
            } else {
                mi::mi_zalloc_aligned(size, align).cast()
            }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let align = layout.align();
        unsafe {
            if naturally_aligned(new_size, align) {
                mi::mi_realloc(ptr.cast::<c_void>(), new_size).cast()
            } else {
                mi::mi_realloc_aligned(ptr.cast::<c_void>(), new_size, align).cast()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `p` is a block aligned to `align`.
    fn aligned(p: *mut u8, align: usize) -> bool {
        !p.is_null() && (p as usize).is_multiple_of(align)
    }

    /// Whether the block at `p` holds 0, 1, 2, ... (as bytes) in its first `n` bytes.
    unsafe fn counts_up(p: *mut u8, n: usize) -> bool {
        (0..n).all(|i| unsafe { *p.add(i) } == i as u8)
    }

    /// One layout through each entry point: aligned, zeroed where asked,
    /// writable to its last byte, and its bytes kept across a shrinking and
    /// a growing realloc (and back).
    unsafe fn check(size: usize, align: usize) {
        let layout = Layout::from_size_align(size, align).unwrap();
        unsafe {
            let zeroed = Mimalloc.alloc_zeroed(layout);
            assert!(aligned(zeroed, align), "zalloc {size} {align}");
            assert!(
                (0..size).all(|i| *zeroed.add(i) == 0),
                "zalloc {size} {align}"
            );
            Mimalloc.dealloc(zeroed, layout);

            let mut p = Mimalloc.alloc(layout);
            assert!(aligned(p, align), "alloc {size} {align}");
            for i in 0..size {
                *p.add(i) = i as u8;
            }
            for new_size in [size / 2 + 1, size * 3] {
                let q = Mimalloc.realloc(p, layout, new_size);
                let kept = size.min(new_size);
                assert!(aligned(q, align), "realloc {size} -> {new_size} {align}");
                assert!(counts_up(q, kept), "realloc {size} -> {new_size} {align}");
                let q_layout = Layout::from_size_align(new_size, align).unwrap();
                p = Mimalloc.realloc(q, q_layout, size);
                assert!(aligned(p, align), "realloc {new_size} -> {size} {align}");
                for i in kept..size {
                    *p.add(i) = i as u8;
                }
                assert!(counts_up(p, size), "realloc {new_size} -> {size} {align}");
            }
            Mimalloc.dealloc(p, layout);
        }
    }

    /// Sizes on both sides of mimalloc's classes (8-byte blocks, 24 bytes
    /// at 16-byte alignment, its 1 KiB small-block limit, large blocks) at
    /// alignments below, at and above 16.
    #[test]
    fn blocks_are_aligned_and_keep_their_bytes() {
        let sizes = [
            1,
            3,
            8,
            12,
            16,
            24,
            40,
            100,
            1024,
            1025,
            4000,
            65536,
            1 << 20,
        ];
        for align in [1, 2, 4, 8, 16, 32, 64, 4096] {
            for size in sizes {
                unsafe { check(size, align) };
            }
        }
    }
}
