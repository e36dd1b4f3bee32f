//! The kernel sources and their compilation: each `kernels/*.cu` file, with
//! `common.cuh` in front, compiled by NVRTC to a CUBIN for one architecture
//! (`sm_90a`, `sm_100a`, `sm_103a`, ...). Compiling for a real architecture runs
//! ptxas too, so inline PTX that the target lacks fails here, not at load time.
//! CUBINs are cached on disk, keyed by source, options, architecture and NVRTC
//! version.

use std::ffi::{CStr, CString, c_char, c_int};
use std::path::PathBuf;

use cudarc::nvrtc::sys;

/// One kernel file: its name, source, and the architectures it is built
/// for (empty: every one).
#[derive(Clone, Copy, Debug)]
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub only_for: &'static [&'static str],
}

impl KernelFile {
    /// Whether this file is built (and loaded) for `arch`.
    pub fn builds_for(&self, arch: &str) -> bool {
        self.only_for.is_empty() || self.only_for.contains(&arch)
    }
}

/// The architectures with tcgen05 (B200, B300): `fp4_blackwell.cu`'s targets.
pub const TCGEN05_ARCHS: &[&str] = &["sm_100a", "sm_103a"];

/// Put in front of every file.
const COMMON: &str = include_str!("../../../../kernels/common.cuh");

/// Every kernel file, in the order `sluice kernels compile` reports them.
pub const KERNEL_FILES: &[KernelFile] = &[
    KernelFile {
        name: "weights.cu",
        source: include_str!("../../../../kernels/weights.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "layers.cu",
        source: include_str!("../../../../kernels/layers.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "gemv.cu",
        source: include_str!("../../../../kernels/gemv.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "attention.cu",
        source: include_str!("../../../../kernels/attention.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "transfer.cu",
        source: include_str!("../../../../kernels/transfer.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "fp4.cu",
        source: include_str!("../../../../kernels/fp4.cu"),
        only_for: &[],
    },
    KernelFile {
        name: "fp4_blackwell.cu",
        source: include_str!("../../../../kernels/fp4_blackwell.cu"),
        only_for: TCGEN05_ARCHS,
    },
];

/// The architectures CI compiles for: Hopper (measured on H200) and Blackwell
/// (B200 and B300, compile-checked).
pub const CHECKED_ARCHS: &[&str] = &["sm_90a", "sm_100a", "sm_103a"];

const OPTIONS: &[&str] = &["--std=c++17", "--fmad=true", "-default-device"];

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(
        "NVRTC (libnvrtc.so.13) could not be loaded: put its folder on LD_LIBRARY_PATH \
         (CUDA 13.0's lib folder, or pip's nvidia/cu13/lib; see GPU.md)"
    )]
    NoNvrtc,
    #[error("{file} for {arch}: {call} failed ({code:?})\n{log}")]
    Nvrtc {
        file: &'static str,
        arch: String,
        call: &'static str,
        code: sys::nvrtcResult,
        log: String,
    },
}

/// True when libnvrtc can be loaded.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version, as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    Ok((major, minor))
}

/// A program and the source it was created from (NVRTC may point into it).
struct Program {
    handle: sys::nvrtcProgram,
    _source: CString,
    _name: CString,
}

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed once, here.
        unsafe { sys::nvrtcDestroyProgram(&mut self.handle) };
    }
}

impl Program {
    fn log(&self) -> String {
        let mut size = 0usize;
        // SAFETY: a live program; the buffer has the size NVRTC asked for.
        unsafe {
            if sys::nvrtcGetProgramLogSize(self.handle, &mut size)
                != sys::nvrtcResult::NVRTC_SUCCESS
            {
                return String::new();
            }
            let mut buf = vec![0 as c_char; size.max(1)];
            sys::nvrtcGetProgramLog(self.handle, buf.as_mut_ptr());
            CStr::from_ptr(buf.as_ptr())
                .to_string_lossy()
                .trim()
                .to_string()
        }
    }
}

/// The full source NVRTC sees for `file`: the embedded one, or with
/// `$SLUICE_KERNEL_DIR` set (a kernel author's loop on a GPU machine: edit,
/// run, no rebuild of the binary) `common.cuh` and the file read from that
/// folder; a file missing there falls back to the embedded source.
pub fn full_source(file: &KernelFile) -> String {
    full_source_from(
        file,
        std::env::var_os("SLUICE_KERNEL_DIR").map(PathBuf::from),
    )
}

fn full_source_from(file: &KernelFile, dir: Option<PathBuf>) -> String {
    let read = |name: &str| std::fs::read_to_string(dir.as_ref()?.join(name)).ok();
    let common = read("common.cuh").unwrap_or_else(|| COMMON.to_string());
    let source = read(file.name).unwrap_or_else(|| file.source.to_string());
    format!("{common}\n#line 1 \"{}\"\n{source}", file.name)
}

/// Compiles `file` for `arch` (a real architecture such as `sm_90a`) into a CUBIN.
pub fn compile(file: &KernelFile, arch: &str) -> Result<Vec<u8>, CompileError> {
    if !nvrtc_present() {
        return Err(CompileError::NoNvrtc);
    }
    let fail = |call, code, log| CompileError::Nvrtc {
        file: file.name,
        arch: arch.to_string(),
        call,
        code,
        log,
    };
    let source = CString::new(full_source(file)).expect("kernel sources hold no NUL");
    let name = CString::new(file.name).expect("file names hold no NUL");
    let mut handle = std::ptr::null_mut();
    // SAFETY: the strings outlive the program (kept in it); no headers.
    let code = unsafe {
        sys::nvrtcCreateProgram(
            &mut handle,
            source.as_ptr(),
            name.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if code != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcCreateProgram", code, String::new()));
    }
    let program = Program {
        handle,
        _source: source,
        _name: name,
    };
    let options: Vec<CString> = OPTIONS
        .iter()
        .map(|o| o.to_string())
        .chain([format!("--gpu-architecture={arch}")])
        .map(|o| CString::new(o).expect("options hold no NUL"))
        .collect();
    let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    // SAFETY: a live program and `pointers.len()` valid C strings.
    let code = unsafe {
        sys::nvrtcCompileProgram(program.handle, pointers.len() as c_int, pointers.as_ptr())
    };
    if code != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(fail("nvrtcCompileProgram", code, program.log()));
    }
    let mut size = 0usize;
    // SAFETY: a compiled program; the buffer has the size NVRTC gave.
    unsafe {
        let code = sys::nvrtcGetCUBINSize(program.handle, &mut size);
        if code != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail("nvrtcGetCUBINSize", code, program.log()));
        }
        let mut cubin = vec![0u8; size];
        let code = sys::nvrtcGetCUBIN(program.handle, cubin.as_mut_ptr().cast());
        if code != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail("nvrtcGetCUBIN", code, program.log()));
        }
        Ok(cubin)
    }
}

/// Where compiled kernels are kept: `$SLUICE_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/sluice/kernels`, else `~/.cache/sluice/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SLUICE_KERNEL_CACHE") {
        return Some(dir.into());
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("sluice").join("kernels"))
}

/// `file` compiled for `arch`, from the disk cache when it is there.
pub fn compile_cached(file: &KernelFile, arch: &str) -> Result<Vec<u8>, CompileError> {
    let (major, minor) = nvrtc_version()?;
    let key = xxhash_rust::xxh3::xxh3_64(
        format!(
            "{}\0{OPTIONS:?}\0{arch}\0{major}.{minor}",
            full_source(file)
        )
        .as_bytes(),
    );
    let stem = file.name.trim_end_matches(".cu");
    let path = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key:016x}.cubin")));
    if let Some(cubin) = path.as_ref().and_then(|p| std::fs::read(p).ok()) {
        return Ok(cubin);
    }
    let cubin = compile(file, arch)?;
    if let Some(path) = path {
        // A cache that cannot be written only costs a compile next time.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = path
            .parent()
            .map_or(Ok(()), std::fs::create_dir_all)
            .and_then(|()| std::fs::write(&tmp, &cubin))
            .and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::debug!(path = %path.display(), error = %e, "kernel cache not written");
        }
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SLUICE_KERNEL_DIR`'s files replace the embedded ones; one missing
    /// there is the embedded source.
    #[test]
    fn sources_come_from_the_kernel_dir_when_there() {
        let dir = std::env::temp_dir().join(format!("sluice-kernel-dir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("gemv.cu"), "// edited gemv\n").unwrap();
        let gemv = KERNEL_FILES.iter().find(|f| f.name == "gemv.cu").unwrap();
        let layers = KERNEL_FILES.iter().find(|f| f.name == "layers.cu").unwrap();
        let edited = full_source_from(gemv, Some(dir.clone()));
        assert!(edited.starts_with(COMMON) && edited.ends_with("// edited gemv\n"));
        assert_eq!(
            full_source_from(layers, Some(dir.clone())),
            full_source_from(layers, None)
        );
        std::fs::write(dir.join("common.cuh"), "// edited common\n").unwrap();
        assert!(full_source_from(layers, Some(dir.clone())).starts_with("// edited common\n"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
