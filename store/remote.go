package store

import (
	"fmt"
	"hash/crc32"
	"math"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// Chunks crossing nodes (docs/CLUSTER.md): a node serves a chunk of its
// host memory to another node's fetch, and stores a chunk it fetched into
// room its engine's PrepareStore gave.

// Lookup is the key's state in host memory and its size.
func (s *Store) Lookup(key messages.Key) (hostpool.State, int64) { return s.pool.Lookup(key) }

// ReadChunk copies a chunk that is ready in host memory out, with the
// CRC-32C taken when it was stored, after checking its bytes against it. A
// chunk only on disk is not read (hostpool.ErrNotReady); a corrupt one is
// dropped (ErrCorrupt in a *hostpool.KeyError, as a load finds it).
func (s *Store) ReadChunk(key messages.Key) ([]byte, uint32, error) {
	b, sum, err := s.readChunk(key)
	return b, sum, named(err)
}

func (s *Store) readChunk(key messages.Key) ([]byte, uint32, error) {
	keys := []messages.Key{key}
	if err := s.pool.PrepareLoad(keys); err != nil {
		return nil, 0, err
	}
	loc, err := s.pool.Locate(keys)
	if err != nil {
		s.pool.CompleteLoad(keys)
		return nil, 0, err
	}
	b := s.arena.Bytes()
	var out []byte
	for _, x := range loc.Chunk(0) {
		out = append(out, b[x.Off:x.Off+x.Len]...)
	}
	s.pool.CompleteLoad(keys)
	if got := crc32.Checksum(out, castagnoli); got != loc.Sums[0] {
		s.pool.Drop(key, loc.Sums[0])
		s.metrics.Corrupt.Inc()
		return nil, 0, &hostpool.KeyError{Key: key, Err: fmt.Errorf("%w: crc32c %08x, stored %08x", ErrCorrupt, got, loc.Sums[0])}
	}
	return out, loc.Sums[0], nil
}

// FillRemote writes a fetched chunk into the room PrepareStore gave key and
// makes it ready with sum (journaled as engine's store), the checksum the serving node stored it with,
// after checking the bytes now in host memory against it. It is made ready
// pinned, so no store evicts it before the load that fetched it pins it
// too: the caller lets go of this pin with UnpinRemote. On any error the
// room is freed, nothing is pinned, and the key stays absent: no
// unverified byte is loadable.
func (s *Store) FillRemote(engine string, key messages.Key, data []byte, sum uint32) error {
	return named(s.fillRemote(engine, key, data, sum))
}

func (s *Store) fillRemote(engine string, key messages.Key, data []byte, sum uint32) error {
	keys := []messages.Key{key}
	loc, err := s.pool.Locate(keys)
	if err == nil && loc.States[0] != hostpool.Pending {
		err = &hostpool.KeyError{Key: key, Err: fmt.Errorf("not pending (%v)", loc.States[0])}
	}
	if err != nil {
		s.pool.CompleteStore(keys, nil)
		return err
	}
	ext := loc.Chunk(0)
	var size int64
	for _, x := range ext {
		size += x.Len
	}
	if size != int64(len(data)) {
		s.pool.CompleteStore(keys, nil)
		return &hostpool.KeyError{Key: key, Err: fmt.Errorf("%w: fetched %d bytes for a %d-byte chunk", hostpool.ErrBadSize, len(data), size)}
	}
	b := s.arena.Bytes()
	at := 0
	for _, x := range ext {
		at += copy(b[x.Off:x.Off+x.Len], data[at:])
	}
	if got := s.checksum(ext, 0, math.MaxInt64, 0); got != sum {
		s.pool.CompleteStore(keys, nil)
		return &hostpool.KeyError{Key: key, Err: fmt.Errorf("%w: crc32c %08x, sent %08x", ErrCorrupt, got, sum)}
	}
	s.pool.By(engine).CompleteStorePinned(keys, []uint32{sum})
	return nil
}

// AbortRemote frees the room of keys whose fetch failed.
func (s *Store) AbortRemote(keys []messages.Key) { s.pool.CompleteStore(keys, nil) }

// PinLocal pins those of keys that are ready in host memory, and those
// pending (another copy filling them) as that copy makes them ready: a
// remote load's own local chunks, which no store may evict while it
// fetches the others (hostpool.Shared.PinReadyOrPending). Unpin lets go of
// these pins.
func (s *Store) PinLocal(keys []messages.Key) *hostpool.Pins { return s.pool.PinReadyOrPending(keys) }

// Unpin lets go of the pins PinLocal took and takes no more.
func (s *Store) Unpin(p *hostpool.Pins) { s.pool.Unpin(p) }

// UnpinRemote lets go of the pins FillRemote left on keys
// (once per pin): they stay ready, evictable again unless a load pins
// them.
func (s *Store) UnpinRemote(keys []messages.Key) { s.pool.CompleteLoad(keys) }
