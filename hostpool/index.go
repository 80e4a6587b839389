package hostpool

import (
	"hash/maphash"

	"github.com/kvactors/kvactors/messages"
)

// keyIndex finds a key's entry. It replaces a map[messages.Key]ref, whose
// operations were ~14% of the node's CPU in the store-heavy bench: a full
// pool churns (every stored chunk is a lookup that misses, an eviction's
// delete and an insert), and each probe of a map of string keys loads a
// control word, a slot's string header and the key bytes, three cache misses
// in a node whose caches NATS and the GC keep cold.
//
// The index is open addressing with linear probing over one pointer-free
// array: a slot is the key's 32-bit tag (the top of its hash) and its entry's
// ref + 1 (0 is an empty slot). A probe compares tags and reads the entry's
// key only on a tag match, an eviction's delete finds its slot by ref without
// reading a key at all, and the GC never scans the array. Deletion shifts the
// rest of the run back (no tombstones: churn at a steady size never
// lengthens probes), and the table doubles at half full, so a miss probes
// about 2.5 slots. The hash is seeded per pool: an engine cannot choose keys
// that collide.
type keyIndex struct {
	seed  maphash.Seed
	slots []uint64
	n     int
}

// minIndexSlots is the smallest table: an empty pool's index costs 512 bytes.
const minIndexSlots = 64

func newKeyIndex(entries int) keyIndex {
	x := keyIndex{seed: maphash.MakeSeed()}
	x.slots = make([]uint64, indexSlotsFor(entries))
	return x
}

// indexSlotsFor is the table size that holds n keys at most half full.
func indexSlotsFor(n int) int {
	s := minIndexSlots
	for s < 2*n {
		s *= 2
	}
	return s
}

func (x *keyIndex) tag(k messages.Key) uint32 {
	return uint32(maphash.String(x.seed, string(k)) >> 32)
}

// home is where a tag's probe starts: its low bits (the tag is the hash's
// top half, so its low bits are as good as any), which also lets a growing
// table place slots again without the keys.
func (x *keyIndex) home(tag uint32) int { return int(tag) & (len(x.slots) - 1) }

func slotOf(tag uint32, r ref) uint64 { return uint64(tag)<<32 | uint64(uint32(r)+1) }
func slotTag(s uint64) uint32         { return uint32(s >> 32) }
func slotRef(s uint64) ref            { return ref(uint32(s) - 1) }

// get returns k's entry.
func (x *keyIndex) get(k messages.Key, entries []entry) (ref, bool) {
	return x.getTagged(k, x.tag(k), entries)
}

// getTagged is get with k's tag already computed.
func (x *keyIndex) getTagged(k messages.Key, tag uint32, entries []entry) (ref, bool) {
	mask := len(x.slots) - 1
	for i := x.home(tag); ; i = (i + 1) & mask {
		s := x.slots[i]
		if s == 0 {
			return none, false
		}
		if slotTag(s) == tag {
			if r := slotRef(s); entries[r].key == k {
				return r, true
			}
		}
	}
}

// put adds the key whose tag is tag (x.tag: the entry keeps it, so
// deleting it later reads and hashes no key), which must be absent, as
// entry r.
func (x *keyIndex) put(tag uint32, r ref) {
	if 2*(x.n+1) > len(x.slots) {
		x.resize(2 * len(x.slots))
	}
	x.place(slotOf(tag, r))
	x.n++
}

// touch reads the slot where tag's probe starts, for its cache line only.
// The index is megabytes, so a probe's first read is a cache miss; reading
// the homes of a decision's keys first, one after another, lets the CPU
// wait for those misses together rather than one per probe. (Go has no
// prefetch instruction; the caller keeps the sum so the read stays.)
func (x *keyIndex) touch(tag uint32) uint64 { return x.slots[x.home(tag)] }

func (x *keyIndex) place(s uint64) {
	mask := len(x.slots) - 1
	i := x.home(slotTag(s))
	for x.slots[i] != 0 {
		i = (i + 1) & mask
	}
	x.slots[i] = s
}

// reserve sizes the table for n keys, so a pool filling up rehashes once.
func (x *keyIndex) reserve(n int) {
	if want := indexSlotsFor(n); want > len(x.slots) {
		x.resize(want)
	}
}

func (x *keyIndex) resize(size int) {
	old := x.slots
	x.slots = make([]uint64, size)
	for _, s := range old {
		if s != 0 {
			x.place(s)
		}
	}
}

// del removes entry r, indexed under tag (put's). Finding the slot by ref
// reads no key: an evicted entry's key is cold.
func (x *keyIndex) del(tag uint32, r ref) {
	want := slotOf(tag, r)
	mask := len(x.slots) - 1
	i := x.home(tag)
	for x.slots[i] != want {
		if x.slots[i] == 0 {
			return // not indexed: nothing to remove
		}
		i = (i + 1) & mask
	}
	// Shift the run after i back over the hole: a slot moves into the hole
	// unless its home lies cyclically in (hole, its position], where a probe
	// for it would stop at the hole before reaching it.
	hole := i
	for j := (i + 1) & mask; x.slots[j] != 0; j = (j + 1) & mask {
		h := x.home(slotTag(x.slots[j]))
		if (j-h)&mask >= (j-hole)&mask {
			x.slots[hole] = x.slots[j]
			hole = j
		}
	}
	x.slots[hole] = 0
	x.n--
}
