// Package backend defines how kvactors reaches memory: a Backend attaches an
// engine's device segments and allocates the host pool's arena, and an
// Attachment (one engine's attached segments) copies byte ranges between the
// two. It owns the interface, the Range type,
// and nothing else; shm (the default) and cuda (build tag cuda) implement it,
// and backendtest is the conformance suite both run.
package backend
