// Package disk is the pool's disk tier: chunks evicted from host memory are
// written here (by one writer goroutine, off the copy path) instead of
// vanishing, kept under a byte budget with their own LRU, and read back into
// host memory for a load, verifying their CRC-32C.
//
// Chunks are records appended to segment files (NNNNNNNN.kvseg), each a
// self-describing record: a header with the key, size and data checksum,
// protected by its own checksum; then the data. The writer appends a batch
// at a time: the spills already queued when it takes one (never waiting for
// more), several records per write call. A record is indexed, and announced
// stored, only once the write holding it has returned; a failed write cuts
// the segment back to where its run began (the batch's records bound for
// that segment, none of which is indexed; a batch that rolled into a new
// segment keeps the records written to the earlier one). If that cut
// fails too, the segment is retired (counted): its file may now run past
// its last record, where an append would land instead of where its offsets
// say, so later records go to a new segment. A record dropped while its
// bytes stay in their segment (evicted past the budget, dropped by a read
// that found it bad, or by Drop) gets a tombstone: a header-only record
// naming its segment and offset, appended by the writer right after the
// batch, or the drop, that dropped it. On open the index is rebuilt from
// the segments as write order leaves it, records their tombstones name
// left out (a later record of the key stays), trimmed to the budget from
// the earliest written. The rebuild walks back from the newest segment, so
// it holds what the budget keeps, not what the directory holds, and
// deletes unread the segments older than the oldest chunk kept. Every
// record read has its checksums verified: a record cut short or whose header fails its checksum is a torn tail, and the
// segment is cut there, so the records before it survive (in its batch or
// earlier) and the torn one and all after it go; a record of full length
// whose data fails its checksum is skipped, and each record after it is kept
// only if its own checksums hold. A read that fails (EIO) is not a torn
// tail: Open fails, naming the segment, and cuts nothing.
//
// Durability: segments are not fsynced; the tier's durability is the page
// cache's. A restart after a process crash (kill -9: the page cache
// survives the process) or a Close finds the chunks that were on disk and
// none dropped before: only a record dropped in the moment before a crash,
// its tombstone not yet written, comes back, and where that puts the chunks
// over the budget the earliest written go. The order of use is not kept:
// after a restart the least recently used chunk is the earliest written. A
// power loss may lose or tear recent records and tombstones, which the
// rebuild then finds and discards, so a torn chunk is never served.
package disk
