//! What a parameter is at the C calling convention: a pointer, an integer or a float of some
//! width, a struct passed by value. [`crate::header`] says it of every entry point as `cuda.h`
//! declares it; [`AbiOf`] says it of a Rust type, so that a declaration can be checked against the
//! header at compile time ([`same`] in a `const` assertion).

/// A parameter's kind and width (bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Abi {
    Ptr,
    Int(u8),
    Float(u8),
    Struct(u16),
}

/// A Rust type's [`Abi`].
pub trait AbiOf {
    const ABI: Abi;
}

macro_rules! ints {
    ($($t:ty),*) => { $(impl AbiOf for $t { const ABI: Abi = Abi::Int(std::mem::size_of::<$t>() as u8); })* };
}
ints!(i8, u8, i16, u16, i32, u32, i64, u64, isize, usize);

impl AbiOf for f32 {
    const ABI: Abi = Abi::Float(4);
}

impl AbiOf for f64 {
    const ABI: Abi = Abi::Float(8);
}

impl<T> AbiOf for *mut T {
    const ABI: Abi = Abi::Ptr;
}

impl<T> AbiOf for *const T {
    const ABI: Abi = Abi::Ptr;
}

const fn same_one(a: Abi, b: Abi) -> bool {
    match (a, b) {
        (Abi::Ptr, Abi::Ptr) => true,
        (Abi::Int(x), Abi::Int(y)) | (Abi::Float(x), Abi::Float(y)) => x == y,
        (Abi::Struct(x), Abi::Struct(y)) => x == y,
        _ => false,
    }
}

/// Whether two parameter lists are the same at the calling convention (usable in `const`).
pub const fn same(a: &[Abi], b: &[Abi]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if !same_one(a[i], b[i]) {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_types_and_the_header_compare_by_kind_and_width() {
        assert!(same(&[<*mut u8>::ABI, usize::ABI], crate::header::cuMemAlloc_v2));
        assert!(!same(&[<*mut u8>::ABI, u32::ABI], crate::header::cuMemAlloc_v2), "a 32-bit size");
        assert!(same(&[<*mut u32>::ABI, u32::ABI], crate::header::cuMemAlloc), "the original entry point");
        assert!(!same(&[<*mut u8>::ABI], crate::header::cuMemAlloc_v2), "a parameter short");
    }
}
