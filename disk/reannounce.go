package disk

import (
	"strings"

	"github.com/kvactors/kvactors/messages"
)

// Reannounce tells Notify again of every chunk on disk, as stored (each
// for the engine that spilled it, "" for one found at open), in Notify's
// order with the changes made meanwhile (see ReannouncePrefix): a node
// whose published changes may have been lost (a NATS outage) states what
// the disk holds. Nothing after Close.
func (d *Disk) Reannounce() { d.ReannouncePrefix("", nil) }

// ReannouncePrefix is Reannounce of the chunks whose keys start with
// prefix only (a node tells routers of one namespace's chunks, found at
// open, when the namespace first registers in its boot). A chunk keep (if
// not nil) refuses is dropped instead, told removed, not stored: one no
// load can take (a size its key's chunks never have). keep runs under the
// lock, as Notify does. It returns the chunks dropped.
//
// It walks the LRU list reannounceSlice entries per hold of the lock, a
// cursor keeping its place between holds, so stores and loads of the tier
// run between the slices. Each slice's chunks are told under the hold that
// found them indexed: a chunk dropped before its slice is not told, and one
// dropped after it has its removal told after it (Notify's order). A chunk
// read meanwhile (moved to the back) or written may be told twice.
func (d *Disk) ReannouncePrefix(prefix string, keep func(key messages.Key, size int64) bool) (dropped int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.shut {
		return 0
	}
	at := d.lru.PushFront(cursor{})
	defer d.lru.Remove(at) // before the deferred unlock
	for {
		var changes []change
		var refused []*item
		e := at.Next()
		for n := 0; e != nil && n < reannounceSlice; n, e = n+1, e.Next() {
			if it, ok := e.Value.(*item); ok && strings.HasPrefix(string(it.key), prefix) {
				if keep == nil || keep(it.key, it.size) {
					changes = append(changes, change{engine: it.engine, key: it.key, stored: true})
				} else {
					refused = append(refused, it)
				}
			}
		}
		if e != nil {
			// The place is kept before any drop: a segment the drops leave
			// dead takes its records, e's among them, out of the list, the
			// cursor never.
			d.lru.MoveBefore(at, e)
		}
		if len(refused) > 0 {
			changes = append(changes, d.dropLocked("", refused...)...)
			dropped += len(refused)
			d.wakeWriter() // the tombstones
		}
		d.tell(changes)
		if e == nil {
			return dropped
		}
		d.mu.Unlock()
		if d.cfg.betweenSlices != nil {
			d.cfg.betweenSlices()
		}
		d.mu.Lock()
		if d.shut {
			return dropped
		}
	}
}

// reannounceSlice is the most LRU entries ReannouncePrefix walks per hold
// of the lock: one hold over 1M chunks kept the tier's stores and loads
// waiting ~30 ms per namespace, and 0.4 to 0.9 s for Reannounce (telling
// all; BenchmarkReannouncePrefix).
const reannounceSlice = 4096

// cursor marks a ReannouncePrefix walk's place in the LRU list between its
// holds of the lock; every other walk of the list skips it.
type cursor struct{}
