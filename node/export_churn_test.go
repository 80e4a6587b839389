package node

import (
	"strconv"

	cmap "github.com/orcaman/concurrent-map"
)

// Footprint counts what the node keeps per engine, request and namespace
// now: the maps of node/ (under their locks), the actor system's process
// registry, the embedded server's subscriptions. A churn test compares it
// before and after engines come and go.
func (n *Node) Footprint() map[string]int {
	f := map[string]int{}
	n.mu.Lock()
	f["engines"] = len(n.engines)
	f["cleared"] = len(n.cleared)
	f["releases"] = len(n.releases)
	f["ending"] = len(n.ending)
	f["epochs"] = len(n.epochs)
	f["departed"] = len(n.departed.last)
	f["mapped"] = n.mapped
	f["mapped_bytes"] = int(n.mappedBytes)
	f["ns_member"] = len(n.nss.member)
	f["ns_opened"] = len(n.nss.opened)
	f["namespaces"] = len(n.nss.byID)
	members := 0
	for _, ns := range n.nss.byID {
		members += len(ns.members)
	}
	f["ns_members"] = members
	n.mu.Unlock()

	in := n.ingest
	in.mu.RLock()
	f["ingest_engines"] = len(in.engines)
	f["ingest_hearing"] = len(in.hearing)
	f["ingest_credits"] = len(in.credits)
	in.mu.RUnlock()
	in.footprintBytes(f)
	in.lostMu.Lock()
	f["ingest_lost"] = len(in.lost)
	f["ingest_alive"] = len(in.alive)
	in.lostMu.Unlock()
	parked := 0
	for i := range in.marks {
		m := &in.marks[i]
		m.parkMu.Lock()
		parked += len(m.parked)
		m.parkMu.Unlock()
	}
	f["ingest_parked"] = parked

	n.claims.mu.Lock()
	f["claim_locks"] = len(n.claims.keys)
	n.claims.mu.Unlock()

	pids := 0
	for _, b := range n.system.ProcessRegistry.LocalPIDs.LocalPIDs {
		pids += b.Count()
	}
	f["actors"] = pids
	if n.ns != nil {
		f["server_subs"] = int(n.ns.NumSubscriptions())
	}
	f["node_subs"] = len(n.subs)
	if n.cl != nil {
		f["cluster_mine"] = len(n.cl.owners.Mine())
		n.cl.dropped.mu.Lock()
		f["cluster_dropped"] = len(n.cl.dropped.ids)
		n.cl.dropped.mu.Unlock()
		f["cluster_peers"] = len(n.cl.feed.Nodes())
		f["cluster_subs"] = len(n.cl.subs)
	}
	return f
}

// RequestFootprint counts what the node keeps that a request, a copy or
// a change could add to while its engines stay: per engine id the epochs
// whose release counts are kept, the ending channels and held credits;
// the pool's pins, pending copies and waiters; the kv_events journal's
// records not yet published; the disk's namespace prefixes. A soak test
// compares it across many requests.
func (n *Node) RequestFootprint() map[string]int {
	f := map[string]int{}
	n.mu.Lock()
	for _, r := range n.releases {
		f["release_epochs"] += r.Epochs()
	}
	for _, t := range n.epochs {
		f["epoch_trail"] += len(t.Recent())
	}
	for _, chs := range n.ending {
		f["ending_chans"] += len(chs)
	}
	f["departed_queue"] = len(n.departed.queue)
	for _, b := range n.stateBudgets {
		f["request_state_bytes"] += int(b.Held()) // of live requests: their hashes, block ids and cached keys
	}
	for _, rec := range n.engines {
		f["load_chunks"] += int(rec.loadChunks.Load()) // of loads in flight: none between cycles
		f["copying_loads"] += int(rec.copyingLoads.Load())
	}
	n.mu.Unlock()
	n.ingest.mu.RLock()
	for _, cs := range n.ingest.credits {
		f["ingest_credits_held"] += len(cs)
	}
	n.ingest.mu.RUnlock()
	n.ingest.footprintBytes(f)
	st := n.store.Stats()
	f["pool_pinned"], f["pool_pending"] = st.Pinned, st.Pending
	f["pool_waiting"], f["pool_room_waiting"] = n.store.Waiting()
	n.kv.mu.Lock()
	f["kv_recs"], f["kv_keys"] = len(n.kv.recs), len(n.kv.keys)
	n.kv.mu.Unlock()
	if n.diskKeys != nil {
		n.diskKeys.mu.RLock()
		f["disk_prefixes"] = len(n.diskKeys.byID)
		n.diskKeys.mu.RUnlock()
	}
	n.identity.mu.Lock()
	f["identity_logged"] = len(n.identity.logged)
	n.identity.mu.Unlock()
	return f
}

// footprintBytes puts in f the bytes intake holds now, in total and summed over
// its buckets: 0 once settled, each bucket too; a release given back to
// another bucket than its admission's, or to none, leaves them apart (and
// its engine's share short for good).
func (in *ingester) footprintBytes(f map[string]int) {
	f["ingest_pending_bytes"] = int(in.pending.Load())
	sum, off := int64(0), 0
	for i := range in.buckets {
		b := in.buckets[i].n.Load()
		sum += b
		if b != 0 {
			off++
		}
	}
	f["ingest_bucket_bytes"], f["ingest_buckets_held"] = int(sum), off
}

// PrimeActorRegistry puts a name in each of the actor registry's 32768
// small maps (1024 buckets of 32 shards) and takes it out again: a map
// keeps the storage its first entry made, so until every map has had one
// each fresh actor name may cost a few heap objects for good (bounded: a
// few MiB at most, over hundreds of thousands of spawns). A test that
// counts heap objects across spawns primes it first.
func (n *Node) PrimeActorRegistry() {
	pids := n.system.ProcessRegistry.LocalPIDs
	seen := map[*cmap.ConcurrentMapShared]bool{}
	for i := 0; len(seen) < len(pids.LocalPIDs)*cmap.SHARD_COUNT && i < 1<<24; i++ {
		name := "prime$" + strconv.Itoa(i)
		b := pids.GetBucket(name)
		if s := b.GetShard(name); !seen[s] {
			seen[s] = true
			b.SetIfAbsent(name, nil)
			b.Remove(name)
		}
	}
}
