//! The report files lockstep writes, seen through h5py the way BMTK's `CompartmentReport` and
//! libsonata's `SomaReportReader` see them (dataset names, dtypes, attributes, the frame count
//! each derives from `mapping/time`).

use lockstep_sonata::{write_report, Report, ReportDtype, ReportPopulation};
use lockstep_testkit::python;

#[test]
fn membrane_report_has_the_layout_bmtk_and_libsonata_read() {
    let dir = tempfile::tempdir().unwrap();
    let nodes = vec![2u64, 5, 11];
    let frames = 7usize;
    let data: Vec<f64> = (0..frames * nodes.len())
        .map(|i| -70.0 + i as f64 / 3.0)
        .collect();
    let report = Report {
        variable: "V_m".into(),
        populations: vec![ReportPopulation::single_compartment(
            "v1",
            nodes,
            0.2,
            0.1,
            data.clone(),
            "mV",
        )],
    };
    for (dtype, name, np_type) in [
        (ReportDtype::Float64, "r64.h5", "float64"),
        (ReportDtype::Float32, "r32.h5", "float32"),
    ] {
        let f = dir.path().join(name);
        write_report(&f, &report, dtype).unwrap();
        let script = format!(
            r#"
import h5py, numpy as np
f = h5py.File({f:?}, 'r')
assert list(f['report'].keys()) == ['v1']
m = f['report/v1/mapping']
assert m['node_ids'].dtype == np.uint64 and list(m['node_ids'][()]) == [2, 5, 11]
assert m['node_ids'].attrs['sorted'] == 1
for k in ('index_pointers', 'index_pointer'):
    assert m[k].dtype == np.uint64 and list(m[k][()]) == [0, 1, 2, 3], k
assert m['element_ids'].dtype == np.uint32 and list(m['element_ids'][()]) == [0, 0, 0]
assert list(m['element_pos'][()]) == [0.0, 0.0, 0.0]
t = m['time']
assert t.dtype == np.float64 and t.attrs['units'] == 'ms'
start, stop, step = t[()]
d = f['report/v1/data']
assert d.dtype == np.{np_type} and d.shape == (7, 3), (d.dtype, d.shape)
assert d.attrs['units'] == 'mV' and d.attrs['variable'] == 'V_m'
# BMTK: n_steps = int((tstop - tstart) / dt) frames are read
assert int((stop - start) / step) == 7, (start, stop, step)
# libsonata: frames at t = start, start + step, ... while t < stop - 1e-6
n, x = 0, start
while x < stop - 1e-6:
    n += 1; x += step
assert n == 7, n
print(repr(float(d[()][3, 1])))
"#
        );
        let printed = python(&script, &[]);
        let want = match dtype {
            ReportDtype::Float64 => data[3 * 3 + 1],
            ReportDtype::Float32 => data[3 * 3 + 1] as f32 as f64,
        };
        let got: f64 = printed.trim().parse().unwrap();
        assert_eq!(got, want, "{name}: {printed}");
    }
}
