//! Working buffers kept per thread from one attention call to the next: a decode step makes
//! a few calls per layer, each a few tasks, and allocating their buffers afresh (a dozen
//! small vectors a task) was a tenth of a batch-1 step's attention time, during which the
//! other threads waited.

use std::cell::Cell;
use std::thread::LocalKey;

/// One kind of buffers' slot in each thread.
pub(super) type Slot<T> = LocalKey<Cell<Option<T>>>;

/// Runs `f` on this thread's `T` from `slot` (a fresh one when none is kept, or when a
/// caller further up this thread holds it), then keeps it for the next call.
///
/// Not inside a kernel compiled for an instruction set: a closure does not take on its
/// function's target features (its `mul_add`s became calls into libm); those use
/// [`take`] and [`keep`].
#[inline(always)]
pub(super) fn with_reused<T: Default + 'static, R>(
    slot: &'static Slot<T>,
    f: impl FnOnce(&mut T) -> R,
) -> R {
    let mut buffers = take(slot);
    let result = f(&mut buffers);
    keep(slot, buffers);
    result
}

/// This thread's `T` from `slot`, or a fresh one (see [`with_reused`]).
#[inline(always)]
pub(super) fn take<T: Default + 'static>(slot: &'static Slot<T>) -> T {
    slot.with(Cell::take).unwrap_or_default()
}

/// Keeps `buffers` in `slot` for this thread's next [`take`].
#[inline(always)]
pub(super) fn keep<T: 'static>(slot: &'static Slot<T>, buffers: T) {
    slot.with(|s| s.set(Some(buffers)));
}

/// `v` as `len` copies of `value`, in its allocation where that is large enough.
#[inline(always)]
pub(super) fn refill<T: Clone>(v: &mut Vec<T>, len: usize, value: T) {
    v.clear();
    v.resize(len, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SLOT: Cell<Option<Vec<u32>>> = const { Cell::new(None) };
    }

    #[test]
    fn a_thread_gets_its_buffers_back_and_a_nested_caller_fresh_ones() {
        with_reused(&SLOT, |v| v.push(7));
        with_reused(&SLOT, |v| {
            assert_eq!(v, &[7], "kept from the last call");
            with_reused(&SLOT, |inner| assert!(inner.is_empty(), "held further up"));
        });
        let mut v = vec![1, 2, 3];
        refill(&mut v, 2, 9);
        assert_eq!(v, [9, 9]);
    }
}
