#!/usr/bin/env python3
"""Reference values for lockstep-npe's GW chirp task, computed with LALSuite.

Writes tests/data/taylorf2_lal.json (used by tests/npe_library/gw_waveform.rs, which needs no LALSuite):
TaylorF2 plus/cross polarizations from lalsimulation.SimInspiralChooseFDWaveform (3.5PN
phase, 0PN amplitude, zero spins, f_ref = 0, ending at the Schwarzschild ISCO) on the task's
default grid, and the H1/L1 antenna patterns (lal.ComputeDetAMResponse) and arrival-time
offsets from the Earth's centre (lal.TimeDelayFromEarthCenter).

It also times LAL's waveform generation.

Usage: /work/peers/bin/python crates/lockstep-npe/scripts/taylorf2_lal_reference.py
(pip install lalsuite).
"""
import json
import os
import time

import lal
import lalsimulation as ls
import numpy as np

DELTA_F, F_MIN, F_MAX = 0.25, 20.0, 128.0
CASES = [
    # m1, m2 (Msun), distance (Mpc), inclination, phi_c
    (25.0, 18.0, 400.0, 0.4, 1.0),
    (40.0, 12.0, 800.0, 2.1, 4.0),
    (16.0, 15.0, 250.0, 1.2, 0.3),
]
SKY = [(1.375, -1.2108, 2.659, 1126259462.4), (4.0, 0.5, 0.3, 1187008882.4)]


def taylor_f2(m1, m2, dist, iota, phi):
    hp, hc = ls.SimInspiralChooseFDWaveform(
        m1 * lal.MSUN_SI, m2 * lal.MSUN_SI, 0, 0, 0, 0, 0, 0,
        dist * 1e6 * lal.PC_SI, iota, phi, 0, 0, 0,
        DELTA_F, F_MIN, 0.0, 0.0, None, ls.TaylorF2)
    n = int(round((F_MAX - F_MIN) / DELTA_F)) + 1
    k = np.arange(n) + int(round(F_MIN / DELTA_F))
    out = []
    for h in (hp, hc):
        d = h.data.data
        v = np.where(k < len(d), d[np.minimum(k, len(d) - 1)], 0.0)
        out.append(v)
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    cases = []
    t0 = time.perf_counter()
    for (m1, m2, dist, iota, phi) in CASES:
        hp, hc = taylor_f2(m1, m2, dist, iota, phi)
        cases.append({
            "m1": m1, "m2": m2, "distance_mpc": dist, "inclination": iota, "phi_c": phi,
            "hp_re": hp.real.tolist(), "hp_im": hp.imag.tolist(),
            "hc_re": hc.real.tolist(), "hc_im": hc.imag.tolist(),
        })
    dt = (time.perf_counter() - t0) / len(CASES)
    sky = []
    for (ra, dec, psi, gps) in SKY:
        gmst = lal.GreenwichMeanSiderealTime(gps)
        for name, idx in (("H1", lal.LHO_4K_DETECTOR), ("L1", lal.LLO_4K_DETECTOR)):
            det = lal.CachedDetectors[idx]
            fp, fc = lal.ComputeDetAMResponse(det.response, ra, dec, psi, gmst)
            delay = lal.TimeDelayFromEarthCenter(det.location, ra, dec, gps)
            sky.append({"detector": name, "ra": ra, "dec": dec, "psi": psi,
                        "gmst": float(np.mod(gmst, 2 * np.pi)), "fplus": fp, "fcross": fc,
                        "time_delay": delay})
    data = {
        "source": "lalsuite " + lal.__version__ + ", lalsimulation " + ls.__version__,
        "delta_f": DELTA_F, "f_min": F_MIN, "f_max": F_MAX,
        "cases": cases, "sky": sky,
    }
    path = os.path.join(here, "..", "tests", "data", "taylorf2_lal.json")
    with open(path, "w") as f:
        json.dump(data, f)
    print(f"wrote {os.path.normpath(path)} ({data['source']}); "
          f"LAL TaylorF2 {dt * 1e3:.2f} ms per waveform")


if __name__ == "__main__":
    main()
