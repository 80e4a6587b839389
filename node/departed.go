package node

// What the node keeps of an engine id between its registers for the whole
// boot (cleared, releases, epochs, and the namespaces it opened that have
// no member: namespaces.forget) is dropped once the id has been gone for a
// while: a deployment whose engine ids change at every restart (pod
// names) would otherwise grow those maps for the node's life. "A while" is
// counted in departures, not time: an id is forgotten once departedKeep
// other ids have left after it, none of its actors still ending and it
// not registered again, or earlier when a register needs a new namespace
// and the table is full (the table holds fewer than departedKeep).
//
// Forgetting costs an id that does come back after that: one more
// AllBlocksCleared at its register (routers forget what they believed of
// it) and, were it to continue an epoch of before (the Go SDK never does:
// every register is followed by a resync into a new epoch), a release
// numbering that starts again in that epoch.

// departedKeep is how many departed ids are remembered: at least 4096, and
// 16 × --max-engines (every live engine replaced many times over).
func departedKeep(maxEngines int) int { return max(4096, namespacesMost(maxEngines)) }

type departure struct {
	id  string
	seq uint64
}

// departed records ids that left, oldest first. Caller holds n.mu.
type departed struct {
	keep  int // departedKeep of the node's --max-engines
	queue []departure
	last  map[string]uint64 // each id's latest departure
	seq   uint64
}

// forgetOldestDeparted drops the oldest departure, and forgets its id
// unless it is back or ending again: what the node keeps of it and the
// namespaces it owns with no member (namespaces.forget). It reports
// whether it dropped one: false when no id is left. A register may forget
// its own id this way (it reads none of that before): it registers as a
// new one. Caller holds n.mu.
func (n *Node) forgetOldestDeparted() bool {
	d := &n.departed
	for len(d.queue) > 0 {
		old := d.queue[0]
		d.queue[0] = departure{}
		d.queue = d.queue[1:]
		if d.last[old.id] != old.seq {
			continue // left again since: its later departure counts
		}
		delete(d.last, old.id)
		if n.engines[old.id] != nil || len(n.ending[old.id]) > 0 {
			return true // back, or ending again: not gone
		}
		delete(n.cleared, old.id)
		delete(n.releases, old.id)
		delete(n.epochs, old.id)
		delete(n.stateBudgets, old.id) // none of its requests is left: it holds nothing
		n.forgetNamespaces(old.id)
		return true
	}
	return false
}

// departedLocked records that id has no registered engine and no actor
// still ending, and forgets the oldest departed ids past departedKeep.
// Caller holds n.mu.
func (n *Node) departedLocked(id string) {
	d := &n.departed
	if d.last == nil {
		d.last = map[string]uint64{}
	}
	d.seq++
	d.last[id] = d.seq
	d.queue = append(d.queue, departure{id: id, seq: d.seq})
	for len(d.last) > d.keep && n.forgetOldestDeparted() {
	}
	if len(d.queue) > 2*len(d.last)+64 {
		// Ids that leave again and again leave their earlier departures
		// behind: dropped here, so the queue stays within twice the ids.
		kept := make([]departure, 0, 2*len(d.last)+64)
		for _, e := range d.queue {
			if d.last[e.id] == e.seq {
				kept = append(kept, e)
			}
		}
		d.queue = kept
	}
}
