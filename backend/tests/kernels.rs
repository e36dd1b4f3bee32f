//! Every CUDA kernel file compiles, through NVRTC and ptxas, for Hopper
//! (sm_90a) and Blackwell (sm_100a, sm_103a); `fp4_blackwell.cu` (tcgen05)
//! for the Blackwell targets only. Needs libnvrtc.so.13 on
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
    let mut compiled = 0;
    for file in KERNEL_FILES {
        for arch in CHECKED_ARCHS.iter().filter(|a| file.builds_for(a)) {
            compiled += 1;
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
    // Every file for Hopper and both Blackwell targets, the tcgen05 file for
    // the Blackwell ones.
    assert_eq!(compiled, 3 * (KERNEL_FILES.len() - 1) + 2);
}
