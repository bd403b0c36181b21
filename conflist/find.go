package conflist

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
)

// Skipped is a loadable file that is not a valid network configuration.
// containerd's go-cni fails its whole CNI load on such a file (it does not
// skip it like CRI-O does), so callers should report it loudly.
type Skipped struct {
	Path string
	Err  error
}

// ErrNoConfig means the directory holds no valid network configuration yet.
var ErrNoConfig = errors.New("no valid CNI network configuration")

// Scan parses every file of dir a runtime would load (.conf, .conflist, .json)
// in lexical order, as go-cni and ocicni sort them. Files for which ignore
// returns true (our own files) are left out. A missing dir is an empty dir.
func Scan(dir string, ignore func(name string) bool) (valid []*Config, skipped []Skipped, err error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	var names []string
	for _, e := range ents {
		if e.IsDir() || !Loadable(e.Name()) || (ignore != nil && ignore(e.Name())) {
			continue
		}
		names = append(names, e.Name())
	}
	sort.Strings(names)
	for _, n := range names {
		p := filepath.Join(dir, n)
		data, err := ReadFile(p)
		if err == nil {
			var c *Config
			if c, err = Parse(p, data); err == nil {
				valid = append(valid, c)
				continue
			}
		}
		if errors.Is(err, fs.ErrNotExist) { // removed while we listed
			continue
		}
		skipped = append(skipped, Skipped{Path: p, Err: err})
	}
	return valid, skipped, nil
}

// Primary returns the network configuration a runtime would pick: the
// lexically first valid file.
func Primary(dir string, ignore func(name string) bool) (*Config, []Skipped, error) {
	valid, skipped, err := Scan(dir, ignore)
	if err != nil {
		return nil, skipped, err
	}
	if len(valid) == 0 {
		return nil, skipped, ErrNoConfig
	}
	return valid[0], skipped, nil
}
