// Package disk is the pool's disk tier: chunks evicted from host memory are
// written here (by one writer goroutine, off the copy path) instead of
// vanishing, kept under a byte budget with their own LRU, and read back into
// host memory for a load, verifying their CRC-32C.
//
// One file per chunk, named by the key's hex: a self-describing record
// (header with the key, size and data checksum, protected by its own
// checksum; then the data). A file is written under a temporary name and
// renamed into place, so a file under its final name is always whole; on
// open the index is rebuilt from the directory, every record's checksums are
// verified, and temporary or bad files are deleted. Durability: files are
// not fsynced. A process crash (kill -9) loses nothing that was renamed into
// place (the page cache survives the process); a power loss may lose or
// truncate recent files, which the rebuild then finds and discards, so a
// torn chunk is never served.
package disk
