//! The interposer's only output: one prefix, a level from LIBCUDA_LOG_LEVEL, rate-limited.
//! Never called on hot paths.

use std::sync::atomic::{AtomicU32, AtomicU8, Ordering::Relaxed};

pub static LEVEL: AtomicU8 = AtomicU8::new(1);
static LINES: AtomicU32 = AtomicU32::new(0);
const MAX_LINES: u32 = 200;

pub const ERROR: u8 = 0;
pub const WARN: u8 = 1;
pub const INFO: u8 = 2;

pub fn enabled(level: u8) -> bool {
    level <= LEVEL.load(Relaxed)
}

pub fn write(level: u8, msg: std::fmt::Arguments<'_>) {
    if !enabled(level) || LINES.fetch_add(1, Relaxed) >= MAX_LINES {
        return;
    }
    let tag = ["error", "warning", "info", "debug", "trace"][level.min(4) as usize];
    let line = format!("vgpu[{}]: {tag}: {msg}\n", std::process::id());
    // SAFETY: writing a buffer we own to stderr.
    unsafe { libc::write(2, line.as_ptr() as *const libc::c_void, line.len()) };
}

macro_rules! vlog {
    ($lvl:expr, $($a:tt)*) => {
        if $crate::log::enabled($lvl) {
            $crate::log::write($lvl, format_args!($($a)*));
        }
    };
}
pub(crate) use vlog;
