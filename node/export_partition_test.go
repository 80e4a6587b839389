package node

import "time"

// Seams for node/cluster_partition_test.go and node/routecut_chaos_test.go.

// Claims lists the engines this process holds ownership claims on (nil on
// a single node).
func (n *Node) Claims() []string {
	if n.cl == nil || n.cl.owners == nil {
		return nil
	}
	return n.cl.owners.Mine()
}

// ServingEngine is the cluster gate's answer for engine at now: this node
// holds a claim on it whose last successful write was sent less than a
// lease before now (cluster.Owners.Serving).
func (n *Node) ServingEngine(engine string, now time.Time) bool {
	return n.cl != nil && n.cl.owners != nil && n.cl.owners.Serving(engine, now)
}
