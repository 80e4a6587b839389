package node

import (
	"crypto/sha256"
	"encoding/binary"
	"hash/fnv"
	"sync"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// diskKeys maps pool keys to the disk tier's persistent keys and back. A
// pool key starts with a namespace id that is only valid for this boot (ids
// are given in registration order), so a key written to disk under it could
// name another tenant's namespace after a restart. On disk the id is
// replaced by the namespace's name and a fingerprint of its geometry: after a
// restart a chunk comes back only into the same namespace with the same
// geometry (PROTOCOL.md "Isolation"), and is a miss otherwise.
type diskKeys struct {
	mu       sync.RWMutex
	byID     map[sched.NamespaceID]string // id → persistent prefix
	byPrefix map[string]sched.NamespaceID
}

func newDiskKeys() *diskKeys {
	return &diskKeys{byID: map[sched.NamespaceID]string{}, byPrefix: map[string]sched.NamespaceID{}}
}

// learn records namespace id's name and geometry (at register, once the
// namespace has its id) and returns the prefix of its keys on disk, and
// whether this is the first time in the boot (until then none of its
// chunks on disk was visible).
func (d *diskKeys) learn(id sched.NamespaceID, name string, lay *sched.Layout) (prefix string, first bool) {
	p := binary.AppendUvarint(nil, uint64(len(name)))
	p = append(p, name...)
	p = binary.BigEndian.AppendUint64(p, geometry(lay))
	d.mu.Lock()
	_, known := d.byID[id]
	d.byID[id], d.byPrefix[string(p)] = string(p), id
	d.mu.Unlock()
	return string(p), !known
}

// forget drops namespace id's mapping, forgotten (namespaces.forget): its
// keys in the pool no longer reach the disk, and its prefix maps to the id
// of the namespace opened again under its name and geometry, if any.
func (d *diskKeys) forget(id sched.NamespaceID) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p, ok := d.byID[id]
	if !ok {
		return
	}
	delete(d.byID, id)
	if d.byPrefix[p] == id {
		delete(d.byPrefix, p)
	}
}

// ToDisk is k's persistent key; false for a namespace not learnt.
func (d *diskKeys) ToDisk(k messages.Key) (messages.Key, bool) {
	id, rest, ok := splitNS(k)
	if !ok {
		return "", false
	}
	d.mu.RLock()
	p, ok := d.byID[id]
	d.mu.RUnlock()
	if !ok {
		return "", false
	}
	return messages.Key(p + rest), true
}

// FromDisk is the pool key of persistent key k in this boot; false when its
// namespace (with that geometry) is not open in this boot.
func (d *diskKeys) FromDisk(k messages.Key) (messages.Key, bool) {
	n, w := binary.Uvarint([]byte(k))
	if w <= 0 || uint64(len(k)-w) < n+8 {
		return "", false
	}
	end := w + int(n) + 8
	d.mu.RLock()
	id, ok := d.byPrefix[string(k[:end])]
	d.mu.RUnlock()
	if !ok {
		return "", false
	}
	b := binary.BigEndian.AppendUint32(make([]byte, 0, 4+len(k)-end), uint32(id))
	return messages.Key(append(b, k[end:]...)), true
}

// splitNS cuts a pool key into its namespace id and the rest (the offload
// key: hash and group), as sched.AppendKey lays it out.
func splitNS(k messages.Key) (sched.NamespaceID, string, bool) {
	if len(k) < 4 {
		return 0, "", false
	}
	return sched.NamespaceID(binary.BigEndian.Uint32([]byte(k[:4]))), string(k[4:]), true
}

// geometry fingerprints what sched.Layout.SameGeometry compares: a key names
// the same bytes only under the same geometry.
func geometry(l *sched.Layout) uint64 {
	h := fnv.New64a()
	_, _ = h.Write(geometryBytes(l))
	return h.Sum64()
}

// geometryDigest is a collision-resistant digest of l's geometry: what a
// namespace with no member keeps to check a register against (namespace).
func geometryDigest(l *sched.Layout) [sha256.Size]byte { return sha256.Sum256(geometryBytes(l)) }

// geometryBytes encodes what SameGeometry compares.
func geometryBytes(l *sched.Layout) []byte {
	var b []byte
	b = binary.AppendUvarint(b, uint64(l.TokensPerHash))
	b = binary.AppendUvarint(b, uint64(l.BlocksPerChunk))
	for _, g := range l.Groups {
		b = binary.AppendUvarint(b, uint64(g.Kind))
		b = binary.AppendUvarint(b, uint64(g.TokensPerBlock))
		b = binary.AppendUvarint(b, uint64(len(g.Regions)))
		for _, r := range g.Regions {
			b = binary.AppendUvarint(b, uint64(r.BlockBytes))
		}
	}
	return b
}

// reannounceDisk tells routers of the chunks on disk under prefix, a
// namespace's, at its first register in the boot, after that register's
// DISK clear (PROTOCOL.md "kv_events"). It runs off n.mu: the walk covers
// the whole disk index (tens of ms for a million records), and lookups,
// loads, heartbeats and registers of every engine take n.mu. It needs
// nothing n.mu guards: the clear is in the journal before it, the journal
// finds each key's engine off n.mu (kvTarget), a namespace's id is never
// reused within a boot (one forgotten meanwhile: its keys are no
// namespace's, skipped), and a member that
// leaves meanwhile passes the rest to the next one, or to the deferred
// changes of a namespace without one, as for any change of the tier.
func (n *Node) reannounceDisk(nsName, prefix string, keep func(messages.Key, int64) bool) {
	if bad := n.disk.ReannouncePrefix(prefix, keep); bad > 0 {
		n.metrics.Pool.Corrupt.Add(float64(bad))
		n.log.Warn("disk: records of another size than their group's chunks dropped (a load would refuse them)",
			"namespace", nsName, "records", bad)
	}
}

// diskFits is ReannouncePrefix's keep for a namespace of layout lay: a
// record whose size is not its group's chunk size (a geometry the
// fingerprint failed to tell apart, a record left by another build) is
// never loaded (store.Engine.Ready, sizesMatch), so it is not announced
// but dropped. It runs under the disk's lock. Caller holds n.mu.
func (n *Node) diskFits(lay *sched.Layout) func(messages.Key, int64) bool {
	walked := n.diskWalked
	return func(k messages.Key, size int64) bool {
		if walked != nil {
			walked()
		}
		pk, ok := n.diskKeys.FromDisk(k)
		if !ok {
			return true // not this namespace's: not ours to judge
		}
		_, _, g := sched.SplitKey(pk)
		return g >= 0 && g < len(lay.Groups) && size == lay.Groups[g].ChunkBytes
	}
}
