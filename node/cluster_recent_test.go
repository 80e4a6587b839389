package node

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvactors/kvactors/messages"
)

// Two loads from one holder fetch 2 × fetchParallel chunks at once, each
// piece by piece, round robin: after each chunk's first piece every piece
// is served from the cache.
func TestTwoLoadsPiecesAreServedFromTheCache(t *testing.T) {
	var c recentChunksCache
	now := time.Unix(1000, 0)
	reads := 0
	read := func(k messages.Key) {
		if _, ok := c.get(k, now, time.Second); ok {
			return
		}
		reads++
		c.put(servedChunk{key: k, data: make([]byte, 1<<20), at: now})
	}
	keys := make([]messages.Key, 2*fetchParallel)
	for i := range keys {
		keys[i] = messages.Key(fmt.Sprintf("k%d", i))
	}
	for piece := 0; piece < 16; piece++ {
		for _, k := range keys {
			read(k)
		}
	}
	if reads != len(keys) {
		t.Fatalf("%d chunk reads for %d chunks' pieces, want one each", reads, len(keys))
	}
}

func TestRecentChunksAreBoundedAndLeastRecentlyReadGoFirst(t *testing.T) {
	var c recentChunksCache
	now := time.Unix(1000, 0)
	big := recentBytes / 4
	for i := range 4 {
		c.put(servedChunk{key: messages.Key(fmt.Sprint(i)), data: make([]byte, big), at: now})
	}
	if _, ok := c.get("0", now, time.Second); !ok { // 0 is now the most recent
		t.Fatal("chunk 0 not kept")
	}
	c.put(servedChunk{key: "4", data: make([]byte, big), at: now})
	if _, ok := c.get("1", now, time.Second); ok {
		t.Fatal("chunk 1, the least recently read, kept past recentBytes")
	}
	if _, ok := c.get("0", now, time.Second); !ok {
		t.Fatal("chunk 0, read lately, dropped")
	}
	if c.bytes > recentBytes || c.bytes != len(c.chunks)*big {
		t.Fatalf("bytes %d for %d chunks of %d", c.bytes, len(c.chunks), big)
	}
	c.put(servedChunk{key: "huge", data: make([]byte, recentBytes+1), at: now})
	if _, ok := c.get("huge", now, time.Second); ok {
		t.Fatal("a chunk alone past recentBytes kept")
	}
	for i := range 2 * recentChunks {
		c.put(servedChunk{key: messages.Key(fmt.Sprint("s", i)), data: make([]byte, 1), at: now})
	}
	if len(c.chunks) != recentChunks {
		t.Fatalf("%d chunks kept, bound %d", len(c.chunks), recentChunks)
	}
	if _, ok := c.get(messages.Key(fmt.Sprint("s", 2*recentChunks-1)), now.Add(time.Second), time.Second); ok {
		t.Fatal("a chunk read a fetch timeout ago served")
	}
}
