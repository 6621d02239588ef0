//! File formats read and written without model knowledge.
//!
//! Owns: the GGUF reader and writer (`gguf`).
//! May use: nothing.
//! Never uses: gpu, model, tokenizer, engine, server.

pub mod gguf;
pub mod gguf_split;
pub mod gguf_types;
pub mod gguf_write;

/// Drops a read-only file mapping's pages from the process (they stay in the page cache and
/// are read back on the next access), so that reading a large file through its map does not
/// keep it all resident. Best effort: an error leaves the pages mapped.
pub fn release_pages(map: &memmap2::Mmap) {
    release_range(map, 0, map.len());
}

/// `release_pages` of bytes `offset..offset + len` of the map (the pages they touch).
pub fn release_range(map: &memmap2::Mmap, offset: usize, len: usize) {
    #[cfg(unix)]
    // SAFETY: the maps are read-only views of files nothing writes while they are open: after
    // MADV_DONTNEED the next access reads the same bytes back from the file, and slices borrowed
    // from the map stay valid.
    let _ = unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
    #[cfg(not(unix))]
    let _ = (map, offset, len);
}
