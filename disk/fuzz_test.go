package disk

import (
	"os"
	"path/filepath"
	"testing"
)

// Any bytes in a segment file: Open succeeds (cutting a torn tail,
// skipping a record whose data fails its checksum), never panics, keeps
// the live bytes within the budget and never negative, and whatever a key
// reads back matches its checksum.
func FuzzRebuild(f *testing.F) {
	var seed []byte
	for i := range 3 {
		c := []byte{byte(i), 1, 2, 3}
		seed = appendHeader(seed, string(key(i)), int64(len(c)), sum(c))
		seed = append(seed, c...)
	}
	second := int64(len(appendHeader(nil, string(key(0)), 4, 0))) + 4
	seed = appendTombstone(seed, string(key(1)), 1, second)
	f.Add(seed)
	f.Add(appendHeader(nil, "k", -1, 0))
	f.Add(appendHeader(nil, "k", 1<<62, 0))
	f.Fuzz(func(t *testing.T, b []byte) {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "00000001"+segSuffix), b, 0o600); err != nil {
			t.Fatal(err)
		}
		d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		if st := d.Stats(); st.Bytes < 0 || st.Bytes > 1<<20 {
			t.Fatalf("live bytes %d", st.Bytes)
		}
		for _, k := range d.Keys() {
			size, want, ok := d.Has(k)
			if !ok || size < 0 || size > 1<<20 {
				t.Fatalf("key %q size %d", k, size)
			}
			got := make([]byte, size)
			if _, err := d.readInto("e", k, [][]byte{got}); err == nil && sum(got) != want {
				t.Fatalf("key %q served bytes that fail its checksum", k)
			}
		}
	})
}
