//! Which forwarded ops ran while a decode step was captured: a step captured into a CUDA graph
//! must run none (they would run on the inner backend's stream, outside the graph). The
//! generated forwarding (`ops/*.rs`) reports each op here before it calls the inner backend.

/// Set while a strict decode-step capture runs ([`strict_capture`]).
static STRICT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// The forwarded ops called during a strict capture.
static INNER_OPS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// Called by every generated forwarding (`ops/*.rs`) before it calls the inner backend.
#[inline]
pub(crate) fn inner_op(name: &'static str) {
    if STRICT.load(std::sync::atomic::Ordering::Relaxed) {
        INNER_OPS.lock().unwrap().push(name);
    }
}

/// Runs `body` with forwarded ops recorded; returns its result and the ops the inner backend
/// ran meanwhile (a decode step captured into a CUDA graph must have none: they run on the inner
/// backend's stream, outside the graph).
pub(crate) fn strict_capture<T>(body: impl FnOnce() -> T) -> (T, Vec<&'static str>) {
    INNER_OPS.lock().unwrap().clear();
    STRICT.store(true, std::sync::atomic::Ordering::SeqCst);
    let out = body();
    STRICT.store(false, std::sync::atomic::Ordering::SeqCst);
    (out, std::mem::take(&mut *INNER_OPS.lock().unwrap()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn forwarded_ops_are_recorded_during_a_strict_capture() {
        type S = crate::Stoke<burn_ndarray::NdArray<f32>>;
        let (_, ops) = super::strict_capture(|| {
            burn::tensor::Tensor::<S, 1>::ones([4], &Default::default()).exp()
        });
        assert!(ops.contains(&"float_ones"), "{ops:?}");
        assert!(ops.contains(&"float_exp"), "{ops:?}");
    }
}
