// Package ownership is the pure core of engine ownership in a kvactors
// cluster (shared PROTOCOL.md, Clusters): the record stored under an engine
// id in the ownership bucket (node, boot, lease), and Decide, which turns
// what a node read of that record plus its own identity, standby target,
// the register's named node and the time into one action: serve, claim
// (compare-and-set, revision as fencing token), refuse naming the owner, or
// ignore.
//
// It reads no clock and does no I/O: the caller (package cluster) reads the
// bucket, passes now, and performs the claim. It imports only the standard
// library; an import test keeps it that way.
package ownership
