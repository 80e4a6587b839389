package disk

// Stats is a point-in-time view of the disk tier.
type Stats struct {
	Budget     int64 `json:"budget_bytes"`
	Bytes      int64 `json:"bytes"`      // live chunk data
	FileBytes  int64 `json:"file_bytes"` // segment files, dropped records included
	Chunks     int   `json:"chunks"`
	Queued     int64 `json:"queued_bytes"`
	Hits       int64 `json:"hits"`
	Evictions  int64 `json:"evictions"`
	Writes     int64 `json:"writes"` // chunks written
	ReadBytes  int64 `json:"read_bytes"`
	WriteBytes int64 `json:"write_bytes"`
	ReadNanos  int64 `json:"read_nanos"`
	WriteNanos int64 `json:"write_nanos"`
	Dropped    int64 `json:"dropped"`   // spills not written: queue full, closed, too large, key too long
	Raced      int64 `json:"raced"`     // spills whose host bytes changed before the copy-out
	Discarded  int64 `json:"discarded"` // torn tails cut and bad records skipped at open
	Failed     int64 `json:"failed"`    // writes that failed (a chunk's record, or a write of tombstones)
	Retired    int64 `json:"retired"`   // segments written no more: a failed write could not be cut back
	// RemoveFailed: segments whose file failed to delete (each counted
	// once; kept, its bytes in FileBytes, and tried again at the next drop,
	// or the next start where the rebuild deleted it).
	RemoveFailed int64 `json:"remove_failed"`
	// Full: writes that found the filesystem full (ENOSPC, EDQUOT); each
	// deleted the oldest segment to make room, where there was one, and
	// tried once more.
	Full int64 `json:"full"`
}

func (d *Disk) Stats() Stats {
	d.mu.Lock()
	st := Stats{Budget: d.cfg.Bytes, Bytes: d.used, FileBytes: d.fileBytes, Chunks: len(d.items), Queued: d.queued}
	d.mu.Unlock()
	st.Hits, st.Evictions, st.Writes = d.hits.Load(), d.evictions.Load(), d.writes.Load()
	st.ReadBytes, st.WriteBytes = d.readBytes.Load(), d.writeBytes.Load()
	st.ReadNanos, st.WriteNanos = d.readNanos.Load(), d.writeNanos.Load()
	st.Dropped, st.Raced, st.Discarded, st.Failed = d.dropped.Load(), d.raced.Load(), d.discarded.Load(),
		d.failed.Load()
	st.Retired, st.RemoveFailed, st.Full = d.retired.Load(), d.removeFailed.Load(), d.full.Load()
	return st
}
