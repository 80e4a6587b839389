package node

// Seams for node/cluster_partition_test.go.

// Claims lists the engines this process holds ownership claims on (nil on
// a single node).
func (n *Node) Claims() []string {
	if n.cl == nil || n.cl.owners == nil {
		return nil
	}
	return n.cl.owners.Mine()
}
