"""One run's folder, as one component: what it holds and where (`layout`, the only module that names its
files), opening, resuming and saving a run (`folder`), checkpoints (`checkpoint`), and the lock that keeps
a second run out while one writes there (`lock`)."""
