package node

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
