//! Every CUDA kernel file compiles, through NVRTC and ptxas, for Hopper
//! (sm_90a) and Blackwell (sm_100a, sm_103a). Needs libnvrtc.so.13 on
//! LD_LIBRARY_PATH (`make test` installs pip's); without it the test skips,
//! unless SLUICE_REQUIRE_NVRTC=1 (as in `make test`), where it fails.

use sluice_backend::compute::cuda::nvrtc::{CHECKED_ARCHS, KERNEL_FILES, compile, nvrtc_present};

#[test]
fn every_kernel_compiles_for_every_checked_arch() {
    if !nvrtc_present() {
        assert!(
            std::env::var("SLUICE_REQUIRE_NVRTC").as_deref() != Ok("1"),
            "SLUICE_REQUIRE_NVRTC=1 but libnvrtc.so.13 cannot be loaded"
        );
        eprintln!("skipped: no libnvrtc.so.13 on LD_LIBRARY_PATH");
        return;
    }
    let mut failures = Vec::new();
    for file in KERNEL_FILES {
        for arch in CHECKED_ARCHS {
            match compile(file, arch) {
                Ok(cubin) => assert!(
                    cubin.starts_with(b"\x7fELF"),
                    "{} {arch}: not an ELF",
                    file.name
                ),
                Err(e) => failures.push(e.to_string()),
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The text between the `{` that opens at or after `from` and its `}`.
fn braced(source: &str, from: usize) -> &str {
    let open = from + source[from..].find('{').expect("a body");
    let mut depth = 0;
    for (i, c) in source[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return &source[open + 1..open + i];
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced braces")
}

/// Every kernel is launched as a programmatic dependent launch
/// (`Gpu::launch`), so each must wait for the kernel ahead before it uses
/// that kernel's output (kernels/common.cuh): here, that its body calls
/// `pdl_enter` or `pdl_wait`, itself or in the template it forwards to. A
/// kernel without it would race the one ahead of it.
#[test]
fn every_kernel_waits_for_the_kernel_ahead() {
    let waits = |body: &str| body.contains("pdl_enter();") || body.contains("pdl_wait();");
    let mut missing = Vec::new();
    for file in KERNEL_FILES {
        let src = file.source;
        for (at, _) in src.match_indices("extern \"C\" __global__") {
            // `void [__launch_bounds__(n)] name(`
            let head = src[at..].split_once("void ").unwrap().1;
            let head = head
                .strip_prefix("__launch_bounds__(")
                .map_or(head, |h| h.split_once(") ").unwrap().1);
            let name = head.split('(').next().unwrap_or("?").to_string();
            // Past the parameter list: the first `{` after its `)`.
            let params_end = at
                + src[at..]
                    .find(") {")
                    .or_else(|| src[at..].find(")\n{"))
                    .unwrap();
            let body = braced(src, params_end);
            if waits(body) {
                continue;
            }
            // A one-line kernel forwarding to a template: check that.
            let callee = body.trim().split(['<', '(']).next().unwrap_or("").trim();
            let definition = src
                .find(&format!("void {callee}("))
                .map(|d| braced(src, d + src[d..].find(')').unwrap()));
            if !definition.is_some_and(waits) {
                missing.push(format!("{}: {name}", file.name));
            }
        }
    }
    assert!(missing.is_empty(), "kernels that never wait: {missing:?}");
}
