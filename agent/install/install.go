// Package install puts nftcni on a node: it copies the plugin binary into the
// host CNI bin dirs, adds our entry to the host's CNI network configuration in
// one of four modes, keeps both repaired while the node's primary CNI rewrites
// its files, and removes exactly what it added on uninstall.
package install

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/tidwall/gjson"

	"github.com/nftcni/nftcni/conflist"
	"github.com/nftcni/nftcni/internal/atomicfile"
	"github.com/nftcni/nftcni/templates"
)

// Mode says where our plugin entry lives.
type Mode string

const (
	// Chained appends our entry to the primary CNI's own file (default).
	Chained Mode = "chained"
	// Standalone writes a network list of our own (Multus, OpenShift).
	Standalone Mode = "standalone"
	// Owned writes a copy of the primary list plus our entry under a name that
	// sorts first, leaving the primary's file untouched.
	Owned Mode = "owned"
	// DropIn writes <confdir>/<network name>/nftcni.conf, which libcni v1.3+
	// appends to the network's plugins; the primary's file is not touched.
	DropIn Mode = "dropin"
)

// ParseMode validates a mode name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case Chained, Standalone, Owned, DropIn:
		return m, nil
	}
	return "", fmt.Errorf("unknown install mode %q (want chained, standalone, owned or dropin)", s)
}

// Names of the files we own in the conf dir.
const (
	DefaultOwnedName      = "02-nftcni.conflist"
	DefaultStandaloneName = "YYY-nftcni.conflist"
	DropInFileName        = "nftcni.conf"
	// BackupSuffix marks a single-plugin .conf we converted to a .conflist;
	// its extension is one no runtime loads. Uninstall renames it back.
	BackupSuffix = ".nftcni-orig"
)

// Config says what to install and where.
type Config struct {
	ConfDir string
	BinDirs []string
	// PluginBinary is the nftcni executable to copy into every bin dir.
	PluginBinary string
	// ConfName pins the primary file to patch (chained, owned) or names our
	// own file (standalone, owned). Empty means the defaults.
	ConfName string
	Mode     Mode
	// Entry is our rendered plugin object; Standalone our whole list.
	Entry      []byte
	Standalone []byte
	// Runtime is the node's container runtime as Kubernetes reports it
	// ("containerd://2.4.2"); drop-in mode refuses one that reads no
	// drop-ins. Empty: unknown.
	Runtime string
	Log     *slog.Logger
}

// Installer performs install passes; it is safe for one goroutine at a time
// except for the read-only accessors.
type Installer struct {
	cfg    Config
	binary []byte
	binSum [32]byte
	log    *slog.Logger

	mu sync.Mutex
	// written remembers the hash of what we last wrote per path, to tell a
	// revert by another writer from a first install.
	written map[string][32]byte
	// binIDs remembers installed binaries verified since their last change.
	binIDs map[string]fileID
}

// New checks cfg and reads the plugin binary once.
func New(cfg Config) (*Installer, error) {
	if cfg.ConfDir == "" {
		return nil, errors.New("no CNI conf dir given")
	}
	if cfg.Mode == "" {
		cfg.Mode = Chained
	}
	if _, err := ParseMode(string(cfg.Mode)); err != nil {
		return nil, err
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	in := &Installer{cfg: cfg, log: cfg.Log, written: map[string][32]byte{}, binIDs: map[string]fileID{}}
	if cfg.PluginBinary != "" {
		b, err := os.ReadFile(cfg.PluginBinary)
		if err != nil {
			return nil, fmt.Errorf("reading plugin binary: %w (build it, or point --plugin-binary at it)", err)
		}
		in.binary, in.binSum = b, sha256.Sum256(b)
	}
	if cfg.Mode == Standalone && len(cfg.Standalone) == 0 {
		return nil, errors.New("standalone mode needs a rendered standalone config")
	}
	if cfg.Mode != Standalone && len(cfg.Entry) == 0 {
		return nil, errors.New("no plugin entry rendered")
	}
	return in, nil
}

// Result is what one install pass did.
type Result struct {
	// Config is the file that carries our entry (or our own file).
	Config string
	// Primary is the primary CNI's file we read, when there is one.
	Primary string
	// Wrote lists the files this pass wrote.
	Wrote []string
	// Reverted is true when a file we had written was changed by someone
	// else since, and this pass had to write it again.
	Reverted bool
	// Skipped are loadable files that are not valid configs.
	Skipped []conflist.Skipped
}

func (in *Installer) ownedName() string {
	if in.cfg.Mode == Owned && in.cfg.ConfName != "" {
		return in.cfg.ConfName
	}
	return DefaultOwnedName
}

func (in *Installer) standaloneName() string {
	if in.cfg.Mode == Standalone && in.cfg.ConfName != "" {
		return in.cfg.ConfName
	}
	return DefaultStandaloneName
}

// ours tells Scan which files are ours and never a primary.
// It also skips istio-cni's own list (IstioOwnedName): a copy of the
// primary with Istio's plugin, which goes once ours is in place.
func (in *Installer) ours(name string) bool {
	return name == in.ownedName() || name == in.standaloneName() ||
		name == DefaultOwnedName || name == DefaultStandaloneName || name == IstioOwnedName
}

// Install runs one pass: binaries first (a config must never name a plugin
// that is not there yet), then the configuration for the mode. It writes only
// what differs, so a pass over a correct install writes nothing.
func (in *Installer) Install() (Result, error) {
	in.mu.Lock()
	defer in.mu.Unlock()
	var res Result
	bins, err := in.installBinaries()
	res.Wrote = append(res.Wrote, bins...)
	if err != nil {
		return res, err
	}
	switch in.cfg.Mode {
	case Chained:
		err = in.ensureChained(&res)
	case Owned:
		err = in.ensureOwned(&res)
	case Standalone:
		err = in.ensureStandalone(&res)
	case DropIn:
		err = in.ensureDropIn(&res)
	}
	if err == nil && in.cfg.Mode != Standalone {
		err = in.takeOverFromIstio(&res)
	}
	return res, err
}

func (in *Installer) installBinaries() ([]string, error) {
	if in.binary == nil {
		return nil, nil
	}
	var wrote []string
	for _, dir := range in.cfg.BinDirs {
		dst := filepath.Join(dir, templates.PluginType)
		if in.binaryIntact(dst) {
			continue
		}
		if err := atomicfile.WriteFile(dst, in.binary, &atomicfile.FileMeta{Mode: 0o755, UID: os.Geteuid(), GID: os.Getegid()}); err != nil {
			if errors.Is(err, syscall.EROFS) {
				return wrote, fmt.Errorf("installing %s: bin dir %s is read-only: on GKE the writable CNI bin dir is /home/kubernetes/bin (set --cni-bin-dir or the chart's platform profile): %w", dst, dir, err)
			}
			return wrote, fmt.Errorf("installing %s: %w", dst, err)
		}
		in.log.Info("installed plugin binary", "path", dst, "bytes", len(in.binary))
		in.binaryIntact(dst) // record its identity
		wrote = append(wrote, dst)
	}
	return wrote, nil
}

// fileID changes whenever a file is replaced, rewritten or chmod-ed.
type fileID struct {
	dev, ino uint64
	size     int64
	mtime    syscall.Timespec
	ctime    syscall.Timespec
	mode     uint32
}

// binaryIntact reports whether dst is a regular 0755 file holding our
// binary. The hash is computed only when the file's identity changed since
// the last check, so a wake-up does not re-read megabytes.
func (in *Installer) binaryIntact(dst string) bool {
	var st syscall.Stat_t
	if err := syscall.Lstat(dst, &st); err != nil {
		return false
	}
	id := fileID{uint64(st.Dev), st.Ino, st.Size, st.Mtim, st.Ctim, st.Mode}
	if in.binIDs[dst] == id {
		return true
	}
	delete(in.binIDs, dst)
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Mode&0o7777 != 0o755 || st.Size != int64(len(in.binary)) {
		return false
	}
	cur, err := os.ReadFile(dst)
	if err != nil || sha256.Sum256(cur) != in.binSum {
		return false
	}
	in.binIDs[dst] = id
	return true
}

// primary finds the file the runtime uses, honouring a pinned name. A pinned
// X.conf that is missing while X.conflist exists (or the reverse) is taken,
// because we convert the one into the other.
func (in *Installer) primary(res *Result) (*conflist.Config, error) {
	pinned := in.cfg.ConfName
	if in.cfg.Mode == Owned && pinned == in.ownedName() {
		pinned = ""
	}
	if pinned == "" || in.cfg.Mode == Standalone {
		c, skipped, err := conflist.Primary(in.cfg.ConfDir, in.ours)
		res.Skipped = skipped
		if err != nil {
			err = fmt.Errorf("%w in %s", err, in.cfg.ConfDir)
			for _, sk := range skipped {
				err = fmt.Errorf("%w; skipped %v", err, sk.Err)
			}
			return nil, err
		}
		return c, nil
	}
	try := []string{pinned}
	switch filepath.Ext(pinned) {
	case ".conf":
		try = append(try, strings.TrimSuffix(pinned, ".conf")+".conflist")
	case ".conflist":
		try = append(try, strings.TrimSuffix(pinned, ".conflist")+".conf")
	}
	for _, n := range try {
		p := filepath.Join(in.cfg.ConfDir, n)
		data, err := conflist.ReadFile(p)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return conflist.Parse(p, data)
	}
	return nil, fmt.Errorf("%w: pinned file %s not found in %s", conflist.ErrNoConfig, pinned, in.cfg.ConfDir)
}

// chainablePrimary finds the primary config and checks we can chain into
// it. A single-plugin config older than chaining (0.3.0) can be, converted
// to a list at a newer cniVersion its plugin speaks: raise is that version
// ("" for any other config).
func (in *Installer) chainablePrimary(res *Result) (c *conflist.Config, raise string, err error) {
	if c, err = in.primary(res); err != nil {
		return nil, "", err
	}
	res.Primary = c.Path
	old, err := conflist.PredatesChaining(c)
	if err != nil || !old {
		return c, "", err
	}
	if c.Kind != conflist.Single {
		return nil, "", conflist.CheckChainable(c) // a list that old is not a CNI config
	}
	raise, err = in.chainVersion(c)
	return c, raise, err
}

// chainVersion is the cniVersion a single-plugin config older than chaining
// is converted with: the lowest at or above 0.3.0 that its plugin reports
// (CNI VERSION, through libcni's invoke), so the primary is never run at a
// version it does not speak. istio-cni raises every such file to 0.3.1.
func (in *Installer) chainVersion(c *conflist.Config) (string, error) {
	typ := gjson.GetBytes(c.Data, "type").Str
	what := fmt.Sprintf("%s: cniVersion %q predates plugin chaining (0.3.0), so nftcni converts it with a version its plugin %q speaks", c.Path, c.CNIVersion, typ)
	path, err := invoke.FindInPath(typ, in.cfg.BinDirs)
	if err != nil {
		return "", fmt.Errorf("%s, but cannot ask it: %w", what, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := invoke.GetVersionInfo(ctx, path, nil)
	if err != nil {
		return "", fmt.Errorf("%s, but %s did not answer VERSION: %w", what, path, err)
	}
	best := ""
	for _, v := range info.SupportedVersions() {
		chains, err := version.GreaterThanOrEqualTo(v, "0.3.0")
		if err != nil || !chains {
			continue
		}
		if lower, _ := version.GreaterThanOrEqualTo(best, v); best == "" || lower {
			best = v
		}
	}
	if best == "" {
		return "", fmt.Errorf("%s, but %s speaks only %v: nftcni cannot chain after it; use --mode standalone", what, path, info.SupportedVersions())
	}
	return best, nil
}

func (in *Installer) ensureChained(res *Result) error {
	c, raise, err := in.chainablePrimary(res)
	if err != nil {
		return err
	}
	if c.Kind == conflist.Single {
		return in.convertSingle(c, raise, res)
	}
	// Taking over from istio-cni: its entry goes in the same write that
	// adds ours, so the runtime never loads a chain with both plugins or
	// with neither; its binary goes only after that.
	doc, istio, err := conflist.RemoveEntries(c.Data, IstioPluginType)
	if err != nil {
		return fmt.Errorf("removing istio-cni's entry from %s: %w", c.Path, err)
	}
	out, err := conflist.Insert(doc, templates.PluginType, in.cfg.Entry)
	if err != nil {
		return fmt.Errorf("adding nftcni to %s: %w", c.Path, err)
	}
	res.Config = c.Path
	if bytes.Equal(c.Data, out) {
		return nil
	}
	meta, err := atomicfile.Stat(c.Path) // keep the primary's mode and owner
	if err != nil {
		return err
	}
	if err := in.write(c.Path, c.Data, out, &meta, res); err != nil {
		return err
	}
	if istio > 0 {
		in.log.Info("took over from istio-cni: its conflist entry replaced by nftcni's in one write", "config", c.Path)
	}
	return nil
}

// IstioPluginType is istio-cni's plugin type in a conflist.
const IstioPluginType = "istio-cni"

// IstioOwnedName is istio-cni's own list (ISTIO_OWNED_CNI_CONFIG), which
// sorts before ours.
const IstioOwnedName = "02-istio-cni.conflist"

// takeOverFromIstio removes what istio-cni left on the node once ours is
// in place, so that no runtime loads Istio's plugin and none is left to
// fail a DEL (a plugin named in a config but not installed): its own list,
// its entry in the primary's file (chained mode removes that in the same
// write that adds ours), then its binary once no config names it. Its
// agent, if still running, removes these itself when it is uninstalled;
// one that stopped for an upgrade leaves them (istio-cni's safe upgrade).
func (in *Installer) takeOverFromIstio(res *Result) error {
	owned := filepath.Join(in.cfg.ConfDir, IstioOwnedName)
	if data, err := conflist.ReadFile(owned); err == nil && len(conflist.Entries(data, IstioPluginType)) > 0 {
		if err := atomicfile.RemoveFile(owned); err != nil {
			return fmt.Errorf("removing istio-cni's own config %s: %w", owned, err)
		}
		in.log.Info("took over from istio-cni: removed its own config", "path", owned)
		res.Wrote = append(res.Wrote, owned)
	}
	if in.cfg.Mode != Chained && res.Primary != "" {
		data, err := conflist.ReadFile(res.Primary)
		if err != nil {
			return err
		}
		out, n, err := conflist.RemoveEntries(data, IstioPluginType)
		if err != nil {
			return fmt.Errorf("removing istio-cni's entry from %s: %w", res.Primary, err)
		}
		if n > 0 {
			meta, err := atomicfile.Stat(res.Primary)
			if err != nil {
				return err
			}
			if err := in.write(res.Primary, data, out, &meta, res); err != nil {
				return err
			}
			in.log.Info("took over from istio-cni: removed its entry from the primary's config", "config", res.Primary)
		}
	}
	if !in.istioNamed() {
		in.removeIstioBinary()
	}
	return nil
}

// istioNamed says whether any config in the conf dir names istio-cni
// (an istio-cni network Multus attaches, say): then its binary stays.
func (in *Installer) istioNamed() bool {
	ents, _ := os.ReadDir(in.cfg.ConfDir)
	for _, e := range ents {
		if e.Type().IsRegular() {
			if data, err := conflist.ReadFile(filepath.Join(in.cfg.ConfDir, e.Name())); err == nil && len(conflist.Entries(data, IstioPluginType)) > 0 {
				return true
			}
		}
	}
	return false
}

// removeIstioBinary removes istio-cni's plugin from the bin dirs once no
// conflist entry names it; one not there is fine.
func (in *Installer) removeIstioBinary() {
	for _, dir := range in.cfg.BinDirs {
		p := filepath.Join(dir, IstioPluginType)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if err := atomicfile.RemoveFile(p); err != nil {
			in.log.Warn("could not remove istio-cni's plugin binary; no conflist entry names it any more", "path", p, "err", err)
			continue
		}
		in.log.Info("removed istio-cni's plugin binary", "path", p)
	}
}

// convertSingle turns X.conf (or X.json) into X.conflist with our entry, then
// moves X.conf aside to X.conf.nftcni-orig so it no longer sorts first; the
// backup is what uninstall restores. Either step may be interrupted: the
// next pass finds X.conf still first and redoes both.
func (in *Installer) convertSingle(c *conflist.Config, raise string, res *Result) error {
	listPath := strings.TrimSuffix(c.Path, filepath.Ext(c.Path)) + ".conflist"
	if cur, err := conflist.ReadFile(listPath); err == nil {
		if len(conflist.Entries(cur, templates.PluginType)) == 0 {
			return fmt.Errorf("cannot convert %s: %s already exists and is not ours; pin --cni-conf-name or use --mode owned", c.Path, listPath)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	out, err := conflist.FromSingle(c, raise, templates.PluginType, in.cfg.Entry)
	if err != nil {
		return fmt.Errorf("converting %s: %w", c.Path, err)
	}
	meta, err := atomicfile.Stat(c.Path)
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(listPath, out, &meta); err != nil {
		return err
	}
	_, res.Reverted = in.written[listPath] // the primary wrote X.conf again
	in.written[listPath] = sha256.Sum256(out)
	if err := atomicfile.Rename(c.Path, c.Path+BackupSuffix); err != nil {
		return fmt.Errorf("moving converted %s aside: %w", c.Path, err)
	}
	if raise != "" {
		in.log.Info("converted single-plugin config to a list with nftcni, at a cniVersion its plugin speaks: the file's predates plugin chaining",
			"from", c.Path, "to", listPath, "backup", c.Path+BackupSuffix, "cniVersion", c.CNIVersion, "converted-to", raise)
	} else {
		in.log.Info("converted single-plugin config to a list with nftcni", "from", c.Path, "to", listPath, "backup", c.Path+BackupSuffix)
	}
	res.Config = listPath
	res.Wrote = append(res.Wrote, listPath)
	return nil
}

func (in *Installer) ensureOwned(res *Result) error {
	c, raise, err := in.chainablePrimary(res)
	if err != nil {
		return err
	}
	var out []byte
	if c.Kind == conflist.Single {
		out, err = conflist.FromSingle(c, raise, templates.PluginType, in.cfg.Entry)
	} else if out, _, err = conflist.RemoveEntries(c.Data, IstioPluginType); err == nil { // never both in our copy
		out, err = conflist.Insert(out, templates.PluginType, in.cfg.Entry)
	}
	if err != nil {
		return fmt.Errorf("building owned copy of %s: %w", c.Path, err)
	}
	name := in.ownedName()
	if name >= filepath.Base(c.Path) {
		in.log.Warn("owned config does not sort before the primary: runtimes will load the primary and pods bypass nftcni; pick a name that sorts first",
			"owned", name, "primary", filepath.Base(c.Path))
	}
	path := filepath.Join(in.cfg.ConfDir, name)
	res.Config = path
	meta, err := atomicfile.Stat(c.Path)
	if err != nil {
		return err
	}
	cur, _ := conflist.ReadFile(path)
	if bytes.Equal(cur, out) {
		return nil
	}
	return in.write(path, cur, out, &meta, res)
}

func (in *Installer) ensureStandalone(res *Result) error {
	path := filepath.Join(in.cfg.ConfDir, in.standaloneName())
	res.Config = path
	if err := os.MkdirAll(in.cfg.ConfDir, 0o755); err != nil {
		return err
	}
	cur, err := conflist.ReadFile(path)
	if err == nil && conflist.SameJSON(cur, in.cfg.Standalone) {
		return nil
	}
	return in.write(path, cur, in.cfg.Standalone, &atomicfile.FileMeta{Mode: 0o644, UID: os.Geteuid(), GID: os.Getegid()}, res)
}

// SetRuntime records the node's container runtime (see Config.Runtime)
// once it is known, for the passes that follow.
func (in *Installer) SetRuntime(runtime string) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.cfg.Runtime = runtime
}

// Mode is the install mode.
func (in *Installer) Mode() Mode { return in.cfg.Mode }

func (in *Installer) ensureDropIn(res *Result) error {
	if err := dropInsUnread(in.cfg.Runtime); err != nil {
		return err
	}
	c, raise, err := in.chainablePrimary(res)
	if err != nil {
		return err
	}
	if c.Kind == conflist.Single {
		// libcni reads drop-ins only for a list (NetworkConfFromFile); a
		// single-plugin .conf is read without them, so nftcni would never
		// run and meshed pods would start un-captured with no error anywhere.
		return fmt.Errorf("%s is a single-plugin config: runtimes read drop-ins only for a .conflist, so nftcni would never run; use --mode owned (a list of ours beside it) or chained", c.Path)
	}
	if raise != "" {
		return fmt.Errorf("%s: cniVersion %q predates plugin chaining, and a drop-in cannot raise it; use --mode chained or owned", c.Path, c.CNIVersion)
	}
	if gjson.GetBytes(c.Data, "loadOnlyInlinedPlugins").Bool() {
		return fmt.Errorf("%s sets loadOnlyInlinedPlugins: runtimes ignore drop-in plugins for it; use --mode chained or owned", c.Path)
	}
	dir, err := dropInDir(in.cfg.ConfDir, c.Name)
	if err != nil {
		return fmt.Errorf("%s: %w", c.Path, err)
	}
	if st, err := os.Lstat(dir); err == nil && st.Mode()&fs.ModeSymlink != 0 {
		return fmt.Errorf("%s: %w", dir, atomicfile.ErrSymlink)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	path := filepath.Join(dir, DropInFileName)
	res.Config = path
	cur, err := conflist.ReadFile(path)
	if err == nil && conflist.SameJSON(cur, in.cfg.Entry) {
		return nil
	}
	meta, err := atomicfile.Stat(c.Path)
	if err != nil {
		return err
	}
	if err := in.write(path, cur, in.cfg.Entry, &meta, res); err != nil {
		return err
	}
	in.reloadRuntimes()
	return nil
}

// dropInDir is <confdir>/<network name>, refusing names that are not one
// plain path component.
func dropInDir(confDir, network string) (string, error) {
	if network == "" || network == "." || network == ".." || strings.ContainsAny(network, `/\`) {
		return "", fmt.Errorf("network name %q cannot name a drop-in directory", network)
	}
	return filepath.Join(confDir, network), nil
}

func (in *Installer) write(path string, cur, out []byte, meta *atomicfile.FileMeta, res *Result) error {
	if !gjson.ValidBytes(out) { // never replace a file with something worse
		return fmt.Errorf("refusing to write invalid JSON to %s", path)
	}
	if err := atomicfile.WriteFile(path, out, meta); err != nil {
		return err
	}
	if prev, ok := in.written[path]; ok && cur != nil && sha256.Sum256(cur) != prev {
		res.Reverted = true
	}
	in.written[path] = sha256.Sum256(out)
	res.Wrote = append(res.Wrote, path)
	in.log.Info("wrote CNI config with nftcni", "path", path, "mode", in.cfg.Mode)
	return nil
}
