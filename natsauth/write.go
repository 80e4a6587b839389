package natsauth

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// ConfigFile is the configuration's file name in the output directory.
const ConfigFile = "nats-server.conf"

// SecretFile is the file holding user's secret in the output directory:
// <user>.nk (an nkey seed, for nats.NkeyOptionFromSeed or `kvactors serve
// --nats-nkey`) or <user>.password.
func (c Credential) SecretFile() string {
	if c.Seed != "" {
		return c.User + ".nk"
	}
	return c.User + ".password"
}

// Write puts the configuration and every secret into dir (created 0700 if
// missing; files 0600, never overwritten) and returns the paths written.
// It is all or nothing: each file is written in full to a temporary file
// in dir and synced, then linked to its name, which fails if the name
// exists; on an error the names it linked are removed again, and its
// temporary files always are. A configuration whose keys match secrets
// that were not written, or secrets of a set left half written (which
// would also refuse every retry), would be of no use, and a secret
// written in part would be left readable by its owner for nothing.
func (g Generated) Write(dir string) (_ []string, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("natsauth: %w", err)
	}
	files := []struct{ name, data string }{{ConfigFile, g.Config}}
	for _, c := range g.Creds {
		secret := c.Seed
		if secret == "" {
			secret = c.Password
		}
		files = append(files, struct{ name, data string }{c.SecretFile(), secret + "\n"})
	}
	var temps, paths []string
	defer func() {
		for _, t := range temps {
			_ = os.Remove(t)
		}
		if err != nil {
			for _, p := range paths {
				_ = os.Remove(p)
			}
		}
	}()
	for _, f := range files {
		t, err := writeTemp(dir, f.data)
		if t != "" {
			temps = append(temps, t)
		}
		if err != nil {
			return nil, err
		}
	}
	for i, f := range files {
		p := filepath.Join(dir, f.name)
		if err := os.Link(temps[i], p); err != nil {
			if errors.Is(err, fs.ErrExist) {
				err = fs.ErrExist // the link error names the temporary file too
			}
			return nil, fmt.Errorf("natsauth: %s: %w", p, err)
		}
		paths = append(paths, p)
	}
	if err := syncDir(dir); err != nil { // the names, as the files' data are
		return nil, err
	}
	return paths, nil
}

// writeTemp writes data to a new temporary file in dir (0600), synced and
// closed, and returns its path ("" if none was created).
func writeTemp(dir, data string) (string, error) {
	f, err := os.CreateTemp(dir, ".natsauth-*.tmp")
	if err != nil {
		return "", fmt.Errorf("natsauth: %w", err)
	}
	_, err = f.WriteString(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return f.Name(), fmt.Errorf("natsauth: write %s: %w", f.Name(), err)
	}
	return f.Name(), nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("natsauth: %w", err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("natsauth: sync %s: %w", dir, err)
	}
	return nil
}
