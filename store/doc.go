// Package store is the one owner of a node's copy path: it holds the host
// pool (which chunk lives where, hostpool) and the arena (the pool's memory),
// turns a job's chunks into copy ranges (the copy plan), runs the device
// copy, computes each stored chunk's CRC-32C and verifies it before any byte
// is loaded back, and completes the pool (pending to ready, or freed; loads
// unpinned). Everything else reaches it through small interfaces declared
// where they are used: sched.Preparer for a store decision, transfer.Store
// for the copy workers, and the node's lookup and load handlers.
package store
