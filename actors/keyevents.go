package actors

import (
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
	"github.com/kvactors/kvactors/wire"
)

// KeyEvents turns pool keys into kv_events: one event per (namespace,
// group) in first-seen order, each key's hash hex-encoded once. It is the
// one home of the namespace rule for announcements the node makes about
// keys (evictions, load-made room, corrupt chunks, disk writes): each
// namespace's events are handed over separately, so the caller announces
// them, naming that namespace, on an engine of that namespace only (no
// engine learns another namespace's hashes). Its scratch is reused across
// calls: not safe for concurrent use.
type KeyEvents struct {
	sets       []keySet
	slot, next []int
}

// keySet is one event being built: its namespace, group and key count.
type keySet struct {
	ns    sched.NamespaceID
	g     int
	count int
}

// Group calls emit once per namespace of keys, in first-seen order, with
// that namespace's events (typ, medium; Namespace left for emit to name).
// The events are emit's to keep.
func (ke *KeyEvents) Group(keys []messages.Key, typ, medium string,
	emit func(ns sched.NamespaceID, events []messages.KVEvent)) {
	if len(keys) == 0 {
		return
	}
	// A counting sort by (namespace, group), so each event's hashes are one
	// sub-slice of one slice of strings cut from one hex string (a batch
	// rarely spans more than two groups).
	sets, slot := ke.sets[:0], ke.slot[:0]
	n := 0
	for _, k := range keys {
		ns, hash, g := sched.SplitKey(k)
		n += 2 * len(hash)
		i := 0
		for i < len(sets) && (sets[i].ns != ns || sets[i].g != g) {
			i++
		}
		if i == len(sets) {
			sets = append(sets, keySet{ns: ns, g: g})
		}
		sets[i].count++
		slot = append(slot, i)
	}
	hx := make([]byte, 0, n)
	for _, k := range keys {
		_, hash, _ := sched.SplitKey(k)
		hx = wire.AppendHex(hx, string(hash))
	}
	all := wire.Frozen(hx) // hx is not written again
	hashes := make([]string, len(keys))
	next, pos := ke.next[:0], 0 // next free position of each set in hashes
	for _, s := range sets {
		next = append(next, pos)
		pos += s.count
	}
	off := 0
	for i, k := range keys {
		_, hash, _ := sched.SplitKey(k)
		hashes[next[slot[i]]] = all[off : off+2*len(hash)]
		next[slot[i]]++
		off += 2 * len(hash)
	}
	kv := make([]messages.KVEvent, len(sets))
	pos = 0
	for i, s := range sets {
		kv[i] = messages.KVEvent{Type: typ, GroupIdx: s.g, Medium: medium,
			BlockHashes: hashes[pos : pos+s.count : pos+s.count]}
		pos += s.count
	}
	ke.sets, ke.slot, ke.next = sets, slot[:0], next[:0]
	if oneNamespace(sets) { // the usual case: no split, kv goes as it is
		emit(sets[0].ns, kv)
		ke.sets = ke.sets[:0]
		return
	}
	// One call per namespace in first-seen order; sets stays parallel to kv.
	for len(kv) > 0 {
		ns := sets[0].ns
		var batch, rest []messages.KVEvent
		k := 0
		for i := range kv {
			if sets[i].ns == ns {
				batch = append(batch, kv[i])
			} else {
				rest = append(rest, kv[i])
				sets[k] = sets[i]
				k++
			}
		}
		emit(ns, batch)
		kv, sets = rest, sets[:k]
	}
	ke.sets = ke.sets[:0]
}

func oneNamespace(sets []keySet) bool {
	for _, s := range sets[1:] {
		if s.ns != sets[0].ns {
			return false
		}
	}
	return true
}
