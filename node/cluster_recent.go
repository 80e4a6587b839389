package node

import (
	"slices"
	"sync"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// A fetch asks for a chunk piece by piece, and a load fetches fetchParallel
// chunks at once, so a holder serving two loads has 2 × fetchParallel chunks
// in flight. The cache keeps that many and more, least recently read out
// first: with four kept in insertion order, two loads from one holder
// pushed each other's chunks out between pieces, and each piece copied and
// checked its whole chunk again on the serial fetch handler.
const (
	recentChunks = 4 * fetchParallel
	// recentBytes bounds what the kept chunks hold (a chunk can be MiBs).
	recentBytes = 64 << 20
)

type servedChunk struct {
	key  messages.Key
	data []byte
	crc  uint32
	at   time.Time
}

// recentChunksCache is the chunks read for fetches lately, least recently
// read first. Its owner holds mu around get and put.
type recentChunksCache struct {
	mu     sync.Mutex
	chunks []servedChunk
	bytes  int
}

// get returns key's chunk if it was read within ttl of now, and marks it
// the most recently read.
func (c *recentChunksCache) get(key messages.Key, now time.Time, ttl time.Duration) (servedChunk, bool) {
	for i, e := range c.chunks {
		if e.key != key {
			continue
		}
		if now.Sub(e.at) >= ttl {
			return servedChunk{}, false
		}
		copy(c.chunks[i:], c.chunks[i+1:])
		c.chunks[len(c.chunks)-1] = e
		return e, true
	}
	return servedChunk{}, false
}

// put keeps e as the most recently read (replacing key's older copy),
// dropping the least recently read past recentChunks or recentBytes; a
// chunk alone past recentBytes is not kept.
func (c *recentChunksCache) put(e servedChunk) {
	if i := slices.IndexFunc(c.chunks, func(o servedChunk) bool { return o.key == e.key }); i >= 0 {
		c.bytes -= len(c.chunks[i].data)
		c.chunks = slices.Delete(c.chunks, i, i+1) // a key is kept once
	}
	if len(e.data) > recentBytes {
		return
	}
	for len(c.chunks) > 0 && (len(c.chunks) >= recentChunks || c.bytes+len(e.data) > recentBytes) {
		c.bytes -= len(c.chunks[0].data)
		c.chunks = slices.Delete(c.chunks, 0, 1)
	}
	c.chunks = append(c.chunks, e)
	c.bytes += len(e.data)
}
