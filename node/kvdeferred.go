package node

import (
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// kvDeferMost bounds the changes a journal keeps deferred, all namespaces
// together (about 200 bytes each, with a key's string).
const kvDeferMost = 1 << 17

// kvDeferred keeps the kv_events the journal could announce to nobody:
// changes to keys of a namespace that had no member (PROTOCOL.md
// "kv_events"), until an engine joins it. Of each key it keeps only the
// latest change in each medium, in the order of those latest changes: a
// router that applies them after what it was told before ends believing
// what the pool holds, as if it had been told every change in order.
//
// Past most changes kept in all, the namespace holding the most has them
// dropped and is marked cleared: AllBlocksCleared for it, in each medium,
// is published first, and from then on only its keys stored since are kept (a removal
// after a clear tells a router nothing). So a router never believes a key
// held that is gone; at worst it forgets keys still held (missed hits).
//
// Pure logic: no clock, no NATS. Not safe for concurrent use (the
// journal's goroutine owns it).
type kvDeferred struct {
	most int // changes kept at most, all namespaces together
	held int // changes kept now
	byNS map[sched.NamespaceID]*nsDeferred
}

// kvChange is one deferred change: typ (BlockStored, BlockRemoved) of key
// in medium. A blank one was superseded by a later change of its key.
type kvChange struct {
	key         messages.Key
	typ, medium string
}

// changeID is what a later change supersedes: the same key in the same
// medium.
type changeID struct {
	key    messages.Key
	medium string
}

// nsDeferred is one namespace's deferred changes.
type nsDeferred struct {
	list    []kvChange       // in the order of their latest change; superseded ones blank
	at      map[changeID]int // each live change's index in list
	cleared bool             // changes were dropped past the bound: a clear goes first
}

func newKVDeferred(most int) *kvDeferred {
	return &kvDeferred{most: most, byNS: map[sched.NamespaceID]*nsDeferred{}}
}

// add defers typ of keys (all of namespace ns) in medium. It returns how
// many of keys it kept (a removal after ns's clear is not), and how many
// changes kept so far were dropped past the bound (of ns or of another
// namespace).
func (x *kvDeferred) add(ns sched.NamespaceID, typ, medium string, keys []messages.Key) (kept, dropped int) {
	d := x.byNS[ns]
	if d == nil {
		d = &nsDeferred{at: map[changeID]int{}}
		x.byNS[ns] = d
	}
	for _, k := range keys {
		id := changeID{k, medium}
		if i, ok := d.at[id]; ok {
			d.list[i] = kvChange{}
			delete(d.at, id)
			x.held--
		}
		if d.cleared && typ == messages.KVBlockRemoved {
			continue // after the clear a router believes nothing of it
		}
		d.at[id] = len(d.list)
		d.list = append(d.list, kvChange{key: k, typ: typ, medium: medium})
		kept++
		if x.held++; x.held > x.most {
			dropped += x.overflow()
		}
	}
	d.compact() // an overflow leaves another namespace's list empty
	return kept, dropped
}

// overflow drops the changes of the namespace holding the most and marks
// it cleared; it returns how many were dropped.
func (x *kvDeferred) overflow() int {
	var big *nsDeferred
	for _, d := range x.byNS {
		if big == nil || len(d.at) > len(big.at) {
			big = d
		}
	}
	n := len(big.at)
	x.held -= n
	// Fresh ones, not emptied: a map keeps its buckets and a slice its
	// array, so each namespace that once reached the bound would hold that
	// memory until an engine joins it (for one abandoned, never).
	big.list, big.at, big.cleared = nil, map[changeID]int{}, true
	return n
}

// clear drops ns's deferred changes and marks it cleared, as an overflow
// does: its next member is told to forget what it believes of ns first
// (routers may have missed changes of it, see kvJournal.resync).
func (x *kvDeferred) clear(ns sched.NamespaceID) {
	d := x.byNS[ns]
	if d == nil {
		d = &nsDeferred{}
		x.byNS[ns] = d
	}
	x.held -= len(d.at)
	d.list, d.at, d.cleared = nil, map[changeID]int{}, true
}

// compact drops superseded changes once they are most of the list.
func (d *nsDeferred) compact() {
	if len(d.list) <= 2*len(d.at)+16 {
		return
	}
	live := d.list[:0]
	for _, c := range d.list {
		if c.typ != "" {
			d.at[changeID{c.key, c.medium}] = len(live)
			live = append(live, c)
		}
	}
	clear(d.list[len(live):])
	d.list = live
}

// has reports whether ns has anything deferred.
func (x *kvDeferred) has(ns sched.NamespaceID) bool {
	_, ok := x.byNS[ns]
	return ok
}

// take removes ns's deferred changes and returns them: cleared when some
// were dropped (a clear of ns must go before them), and the kept ones in
// the order of their latest change.
func (x *kvDeferred) take(ns sched.NamespaceID) (cleared bool, changes []kvChange) {
	d := x.byNS[ns]
	if d == nil {
		return false, nil
	}
	delete(x.byNS, ns)
	x.held -= len(d.at)
	changes = d.list[:0]
	for _, c := range d.list {
		if c.typ != "" {
			changes = append(changes, c)
		}
	}
	return d.cleared, changes
}
