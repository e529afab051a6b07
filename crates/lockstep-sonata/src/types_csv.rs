//! Node-types and edge-types tables: the space-separated CSV files of SONATA.
//!
//! Format (SONATA spec, "Node types file" / "Edge types file"; written by BMTK with pandas
//! `to_csv(sep=' ')`): a header line of column names, then one line per type. Fields are
//! separated by one or more spaces; a field containing spaces is enclosed in double quotes, a
//! literal quote inside a quoted field is doubled (`""`). The id column (`node_type_id` or
//! `edge_type_id`) is required and unique; every other column is kept as a string.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Result, SonataError, SonataErrorKind};

/// Cell values BMTK/pandas write for "no value".
pub(crate) fn is_null(v: &str) -> bool {
    matches!(v, "" | "NULL" | "None" | "none" | "NONE" | "NaN" | "nan")
}

/// One types table (`node_type_id` or `edge_type_id` plus any columns), all cells as strings.
#[derive(Debug, Clone, PartialEq)]
pub struct TypeTable {
    /// The CSV file it was read from (None when built in memory).
    pub file: Option<PathBuf>,
    /// Name of the id column: `node_type_id` or `edge_type_id`.
    pub id_column: String,
    /// Column names in file order (includes the id column).
    pub columns: Vec<String>,
    /// Cells `[row][column]` as written in the file (quotes removed).
    pub rows: Vec<Vec<String>>,
    /// The type id of each row, `[row]`.
    pub ids: Vec<u64>,
    index: HashMap<u64, usize>,
}

impl TypeTable {
    /// Builds a table in memory. `rows[r][c]` belongs to `columns[c]`; the id column must exist
    /// and hold unique non-negative integers.
    pub fn new(id_column: &str, columns: Vec<String>, rows: Vec<Vec<String>>) -> Result<Self> {
        Self::build(None, id_column, columns, rows, None)
    }

    fn build(
        file: Option<PathBuf>,
        id_column: &str,
        columns: Vec<String>,
        rows: Vec<Vec<String>>,
        lines: Option<Vec<usize>>,
    ) -> Result<Self> {
        let shown = file
            .clone()
            .unwrap_or_else(|| PathBuf::from("<in-memory types table>"));
        let err = |line: usize, problem: String| {
            SonataError::from(SonataErrorKind::Csv {
                path: shown.clone(),
                line,
                problem,
            })
        };
        let id_col = columns.iter().position(|c| c == id_column).ok_or_else(|| {
            err(
                1,
                format!(
                    "header has no '{id_column}' column (columns: {})",
                    columns.join(" ")
                ),
            )
        })?;
        for (i, c) in columns.iter().enumerate() {
            if columns[..i].contains(c) {
                return Err(err(1, format!("column '{c}' appears twice in the header")));
            }
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut index = HashMap::with_capacity(rows.len());
        for (r, row) in rows.iter().enumerate() {
            let line = lines.as_ref().map_or(r + 2, |l| l[r]);
            if row.len() != columns.len() {
                return Err(err(
                    line,
                    format!(
                        "{} fields, but the header has {} columns",
                        row.len(),
                        columns.len()
                    ),
                ));
            }
            let id: u64 = row[id_col].parse().map_err(|_| {
                err(
                    line,
                    format!(
                        "{id_column} '{}' is not a non-negative integer",
                        row[id_col]
                    ),
                )
            })?;
            if index.insert(id, r).is_some() {
                return Err(err(line, format!("{id_column} {id} appears twice")));
            }
            ids.push(id);
        }
        Ok(TypeTable {
            file,
            id_column: id_column.to_string(),
            columns,
            rows,
            ids,
            index,
        })
    }

    /// Reads a space-separated types CSV; `id_column` is `node_type_id` or `edge_type_id`.
    pub fn read(path: &Path, id_column: &str) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| {
            SonataError::from(SonataErrorKind::Io {
                what: format!("{} types file", id_column.trim_end_matches("_type_id")),
                path: path.to_path_buf(),
                origin: "types file".into(),
                cause: source,
            })
        })?;
        Self::parse(&text, path, id_column)
    }

    /// Parses the text of a types CSV (see the module docs for the format); `path` is used in
    /// error messages.
    pub fn parse(text: &str, path: &Path, id_column: &str) -> Result<Self> {
        let mut header: Option<Vec<String>> = None;
        let mut rows = Vec::new();
        let mut lines = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line_no = i + 1;
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() {
                continue;
            }
            let fields = split_fields(line).map_err(|problem| {
                SonataError::from(SonataErrorKind::Csv {
                    path: path.to_path_buf(),
                    line: line_no,
                    problem,
                })
            })?;
            if header.is_none() {
                header = Some(fields);
            } else {
                rows.push(fields);
                lines.push(line_no);
            }
        }
        let header = header.ok_or_else(|| {
            SonataError::from(SonataErrorKind::Csv {
                path: path.to_path_buf(),
                line: 1,
                problem: "file is empty (a header line with at least the id column is required)"
                    .into(),
            })
        })?;
        Self::build(
            Some(path.to_path_buf()),
            id_column,
            header,
            rows,
            Some(lines),
        )
    }

    /// Writes the table as a space-separated CSV (quoting fields that contain spaces, quotes
    /// or are empty), readable by BMTK and by [`TypeTable::read`].
    pub fn write(&self, path: &Path) -> Result<()> {
        let mut out = String::new();
        let line = |fields: &[String], out: &mut String| {
            for (i, f) in fields.iter().enumerate() {
                if i > 0 {
                    out.push(' ');
                }
                if f.is_empty() || f.contains([' ', '"', '\t']) {
                    out.push('"');
                    out.push_str(&f.replace('"', "\"\""));
                    out.push('"');
                } else {
                    out.push_str(f);
                }
            }
            out.push('\n');
        };
        line(&self.columns, &mut out);
        for r in &self.rows {
            line(r, &mut out);
        }
        std::fs::write(path, out).map_err(|source| {
            SonataError::from(SonataErrorKind::Io {
                what: "types file".into(),
                path: path.to_path_buf(),
                origin: "write".into(),
                cause: source,
            })
        })
    }

    /// Number of types (rows).
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Row of type `id`, if defined.
    pub fn row_of(&self, id: u64) -> Option<usize> {
        self.index.get(&id).copied()
    }

    /// Index of column `name`, if present.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|c| c == name)
    }

    /// Cell of `row` in column `name`; `None` if the column is absent or the cell is a null
    /// marker (`NULL`, `None`, `NaN` or empty).
    pub fn get(&self, row: usize, name: &str) -> Option<&str> {
        let c = self.column_index(name)?;
        let v = self.rows.get(row)?.get(c)?.as_str();
        (!is_null(v)).then_some(v)
    }

    /// Cell of the type `id` in column `name` (see [`TypeTable::get`]).
    pub fn get_by_id(&self, id: u64, name: &str) -> Option<&str> {
        self.get(self.row_of(id)?, name)
    }

    /// A printable list of the defined ids (for error messages).
    pub(crate) fn known_ids(&self) -> String {
        let mut ids = self.ids.clone();
        ids.sort_unstable();
        let shown: Vec<String> = ids.iter().take(20).map(|i| i.to_string()).collect();
        let more = if ids.len() > 20 { ", ..." } else { "" };
        format!("{}{more}", shown.join(", "))
    }

    /// The CSV file this table was read from, for messages (`<in-memory types table>` when
    /// it was built in memory).
    pub fn shown_path(&self) -> PathBuf {
        self.file
            .clone()
            .unwrap_or_else(|| PathBuf::from("<in-memory types table>"))
    }
}

/// Splits one CSV line on runs of spaces/tabs, honouring double quotes.
fn split_fields(line: &str) -> std::result::Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while matches!(chars.peek(), Some(' ') | Some('\t')) {
            chars.next();
        }
        let Some(&c) = chars.peek() else { break };
        let mut field = String::new();
        if c == '"' {
            chars.next();
            loop {
                match chars.next() {
                    None => return Err(format!("unterminated quoted field after '{field}'")),
                    Some('"') => {
                        if chars.peek() == Some(&'"') {
                            chars.next();
                            field.push('"');
                        } else {
                            break;
                        }
                    }
                    Some(ch) => field.push(ch),
                }
            }
            if let Some(&n) = chars.peek() {
                if n != ' ' && n != '\t' {
                    return Err(format!(
                        "quoted field \"{field}\" is followed by '{n}' instead of a space"
                    ));
                }
            }
        } else {
            while let Some(&ch) = chars.peek() {
                if ch == ' ' || ch == '\t' {
                    break;
                }
                field.push(ch);
                chars.next();
            }
        }
        fields.push(field);
    }
    Ok(fields)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_fields_and_round_trip() {
        let text =
            "edge_type_id target_query syn_weight\n100 \"ei=='e' & x==\"\"y\"\"\" 2.5\n101 * -3\n";
        let t = TypeTable::parse(text, Path::new("t.csv"), "edge_type_id").unwrap();
        assert_eq!(t.ids, vec![100, 101]);
        assert_eq!(t.get_by_id(100, "target_query"), Some("ei=='e' & x==\"y\""));
        assert_eq!(t.get_by_id(101, "syn_weight"), Some("-3"));
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        t.write(&p).unwrap();
        let back = TypeTable::read(&p, "edge_type_id").unwrap();
        assert_eq!(back.rows, t.rows);
        assert_eq!(back.columns, t.columns);
    }

    #[test]
    fn errors_name_line_and_value() {
        let e = TypeTable::parse(
            "node_type_id a\n1 x\nzz y\n",
            Path::new("n.csv"),
            "node_type_id",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("n.csv") && e.contains("line 3") && e.contains("zz"),
            "{e}"
        );
        let e = TypeTable::parse(
            "node_type_id a\n1 x y\n",
            Path::new("n.csv"),
            "node_type_id",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("line 2") && e.contains("3 fields"), "{e}");
        let e = TypeTable::parse("a b\n1 x\n", Path::new("n.csv"), "node_type_id")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no 'node_type_id' column"), "{e}");
        let e = TypeTable::parse("node_type_id\n1\n1\n", Path::new("n.csv"), "node_type_id")
            .unwrap_err()
            .to_string();
        assert!(e.contains("appears twice"), "{e}");
        assert!(TypeTable::parse(
            "node_type_id a\n1 \"x\n",
            Path::new("n.csv"),
            "node_type_id"
        )
        .is_err());
    }
}
